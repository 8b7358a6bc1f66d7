"""A pool of gloo worker processes that runs test functions on every rank.

Launch the pool once per test module (importing megatron costs ~5 s per process)
and run many cases on it::

    @pytest.fixture(scope="module")
    def pool(tmp_path_factory):
        with GlooPool(4, tmp_path_factory.mktemp("gloo")) as p:
            yield p

    def _case(ctx, n):            # module level, so workers can import it
        return ctx.rank * n

    def test_x(pool):
        assert pool.run(_case, 3) == [0, 3, 6, 9]

``fn(ctx, *args, **kwargs)`` runs on all ranks at once; ``ctx`` is the worker's
:class:`WorkerContext` (rank, world size, a per-process ``ProcessGroupCache`` that
outlives single calls, and a scratch dict). Results return per rank, in rank order.
Functions and results travel between the test process and its own children with
``torch.save`` over a local pipe (never over a network).

A failure on any rank raises :class:`WorkerError` with that rank's traceback. If
other ranks are then stuck in a collective, or a call exceeds its timeout, the pool
kills its workers and restarts on the next call. Workers die with the test process
(parent-death signal plus a watchdog), so no process outlives a crashed pytest.

Workers start from a fork server that has imported torch and megatron once
(``PRELOAD``), so a pool of 4 starts in a few seconds and later pools in the same
pytest process start almost instantly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

DEFAULT_TIMEOUT = 300.0
PRELOAD = ("torch", "torch.distributed", "realloc.models.engine", "realloc.models.hf_io", "realloc.models.generation")
FAILURE_GRACE = 10.0  # seconds the other ranks get to finish after one rank failed


class WorkerError(RuntimeError):
    pass


@dataclasses.dataclass
class WorkerContext:
    rank: int
    world_size: int
    groups: Any  # realloc.models.groups.ProcessGroupCache
    scratch: dict = dataclasses.field(default_factory=dict)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        # The test process may not be our direct parent (forkserver), so poll it by pid.
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank: int, world_size: int, store_path: str, conn: Any, parent_pid: int, tmpdir: str) -> None:
    _die_with_parent(parent_pid)
    os.environ["TMPDIR"] = tmpdir
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    from realloc.models.groups import ProcessGroupCache
    from realloc.models.megatron_shim import prepare_device

    prepare_device("cpu")
    ctx = WorkerContext(rank, world_size, ProcessGroupCache())
    conn.send_bytes(_dumps(("ready", rank)))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        job = _loads(data)
        if job is None:
            break
        fn, args, kwargs = job
        try:
            reply = ("ok", fn(ctx, *args, **kwargs))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            reply = ("err", traceback.format_exc())
        try:
            conn.send_bytes(_dumps(reply))
        except Exception:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send_bytes(_dumps(("err", traceback.format_exc())))
    # No destroy_process_group: it waits for the other ranks and the pool is shutting down anyway.
    conn.close()
    os._exit(0)


class GlooPool:
    def __init__(self, world_size: int, workdir: str | Path, start_timeout: float = 120.0,
                 start_method: str = "forkserver") -> None:
        self.world_size = world_size
        self.start_method = start_method
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._generation = 0

    def __enter__(self) -> "GlooPool":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self._kill()
        self._generation += 1
        tmp = self.workdir / f"tmp{self._generation}"
        tmp.mkdir(parents=True, exist_ok=True)
        # A fresh rendezvous file each start: a stale one would hand out dead peers' addresses.
        store = self.workdir / f"store-{os.getpid()}-{self._generation}-{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The fork server imports torch and megatron once; every worker (of every pool in this
            # test process) forks from it instead of paying ~5 s of imports per process.
            ctx.set_forkserver_preload(list(PRELOAD))
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, self.world_size, str(store), child_conn, os.getpid(), str(tmp)))
            p.start()
            child_conn.close()
            self._procs.append(p)
            self._conns.append(parent_conn)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.start_timeout):
                self._kill()
                raise WorkerError(f"gloo worker {rank} did not start within {self.start_timeout:.0f} s")
            status, _ = _loads(conn.recv_bytes())
            assert status == "ready"

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; returns the per-rank results."""
        self.start()
        job = _dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(job)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                break
            progressed = False
            for rank, conn in enumerate(self._conns):
                if rank in results or rank in errors:
                    continue
                if conn.poll(0.05):
                    try:
                        status, value = _loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        status, value = "err", f"worker {rank} died (exit code {self._procs[rank].exitcode})"
                    (results if status == "ok" else errors)[rank] = value
                    progressed = True
            if errors and not progressed:
                deadline = min(deadline, now + FAILURE_GRACE)
        if errors or len(results) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in results and r not in errors]
            if pending:
                self._kill()  # stuck ranks cannot be recovered; the next run() restarts the pool
            if errors:
                rank = min(errors)
                raise WorkerError(f"{fn.__name__} failed on rank {rank} (ranks failed: {sorted(errors)}, "
                                  f"stuck: {pending}):\n{errors[rank]}")
            raise WorkerError(f"{fn.__name__} timed out after {timeout:.0f} s on ranks {pending}")
        return [results[r] for r in range(self.world_size)]

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(_dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()
