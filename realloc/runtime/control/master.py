"""The master worker (realhf.txt §3, §6): runs an execution plan on the model workers over ZMQ.

The master is one class in four parts, each a file of its own:

- ``master_link.py``: numbered requests to the workers, their replies and heartbeats, and the checks that
  stop the run when a worker dies, hangs or fails (with the ordering that keeps collectives deadlock-free);
- ``master_schedule.py``: the augmented, unrolled graph, its nodes' dependencies, running the nodes with
  up to ``window`` iterations in flight, data transfers, and the in-order report of each iteration;
- ``master_eval.py``: evaluation passes;
- ``master_checkpoints.py``: the plan's checkpoint saves and exports, and the last save of a stopped run.

This file holds the state they share, the run from connecting to shutdown, and stopping on a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.asyncio

from realloc.models.groups import ModelLayout
from realloc.runtime.control.master_checkpoints import CheckpointSaves
from realloc.runtime.control.master_eval import EvaluationPasses
from realloc.runtime.control.master_fused import FusedPairs
from realloc.runtime.control.master_link import (CALL_TIMEOUT, HEARTBEAT_TIMEOUT, KILL_GRACE, SHUTDOWN_TIMEOUT,
                                                 MasterLink, RunFailed, WorkerLauncher, plan_node_hosts)
from realloc.runtime.control.master_schedule import IterationSchedule, Node
from realloc.runtime.control.master_tail import ConsumerParts, TailStreams, split_map
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.control.store_listener import StoreListener, port_in_use, store_listener
from realloc.runtime.control.stop_signals import STOP_MARGIN, StopRequest, StopSignals
from realloc.runtime.inputs.evaluation import eval_calls
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.persist import checkpoint
from realloc.runtime.persist.ckpt_lock import reading
from realloc.runtime.persist.export_parts import remove_dead_exports
from realloc.runtime.records.run_paths import RunPaths, os_error_line, remove_secret
from realloc.runtime.records.startup import StartupClock
from realloc.runtime.records.telemetry import RequestLog, RequestRecord, RunStats, Trace
from realloc.runtime.wire import protocol
from realloc.runtime.wire.curve import CurveKeys, Gatekeeper, secure_server

__all__ = ["Master", "RunFailed"]

log = logging.getLogger("realloc.master")


class Master(MasterLink, IterationSchedule, TailStreams, EvaluationPasses, CheckpointSaves, FusedPairs):
    def __init__(self, program: RuntimeProgram, config: RunConfig, run: RunPaths, run_id: str, secret: bytes,
                 *, iterations: int, start_iteration: int = 0, resume: Path | None = None, save_every: int = 0,
                 export_every: int = 0, save_final: bool = False, keep_checkpoints: int = 0,
                 launcher: WorkerLauncher | None = None, bind_host: str = "127.0.0.1", master_port: int = 0,
                 store_port: int = 0, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 call_timeout: float = CALL_TIMEOUT, window: int = 2,
                 stop_signals: StopSignals = StopSignals(), verify_checkpoint: bool = True,
                 schedule_iterations: int | None = None,
                 on_iteration: Callable[[dict[str, Any]], None] | None = None,
                 secret_file: Path | None = None,
                 on_node: Callable[[str, int, float | None], None] | None = None,
                 startup: StartupClock | None = None, store: StoreListener | None = None) -> None:
        if iterations < 1:
            raise ValueError(f"iterations must be at least 1, got {iterations}")
        self.program = program
        self.graph = program.graph
        self.spec = program.graph.spec
        self.config = config
        self.paths = run
        self.run_id = run_id
        self.secret = secret
        self.start = start_iteration
        self.end = start_iteration + iterations
        # The learning-rate schedule's horizon in iterations (run_cli._schedule_horizon); saved in checkpoints.
        self.schedule_iterations = schedule_iterations or self.end
        self.resume = resume
        self.save_every = save_every
        self.export_every = export_every
        self.save_final = save_final  # a checkpoint after the last iteration, whatever save_every says
        self.keep_checkpoints = keep_checkpoints  # delete older ones after each save (0: keep all)
        self.exports: list[asyncio.Task] = []
        self.model_records = self._model_records()
        self.launcher = launcher
        self.heartbeat_timeout = heartbeat_timeout
        self.call_timeout = call_timeout
        # Generation may run eta iterations ahead, and a train step waits for the generation eta iterations
        # later: that many more iterations are in flight.
        self.window = max(1, window, program.staleness + 2)
        self.on_iteration = on_iteration
        # (node label, iteration from 1, None) as a node of the schedule starts, (..., seconds) as it ends: the
        # console's progress inside an iteration (records/progress.py)
        self.on_node = on_node
        self.on_ready: Callable[[], None] | None = None  # the workers are set up: the iterations begin (the console)
        # The secret file this run's launcher gave its workers: removed once every worker has read it (connected),
        # so a run directory that later fills up or turns read-only holds no secret whatever happens next.
        self.secret_file = secret_file
        self.n_workers = self.spec.cluster.n_devices
        # where the run's seconds before its first call went (records/startup.py); run_cli marks its own phases
        self.startup = startup if startup is not None else StartupClock()
        self.offloaded = {m for m, on in program.plan.offload.items() if on and not program.is_rule(m)}

        self.zctx = zmq.asyncio.Context()
        # Only the run's workers complete a handshake, so no other process gets a frame queued (curve.py).
        keys = CurveKeys.of(secret)
        self.gate = Gatekeeper(self.zctx, keys)
        self.sock = self.zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker fails loudly
        secure_server(self.sock, keys)
        self.gate.watch(self.sock)
        if master_port:
            try:
                self.sock.bind(f"tcp://{bind_host}:{master_port}")
            except zmq.ZMQError as e:
                self.gate.close(self.sock)
                self.sock.close()
                self.zctx.term()
                raise port_in_use("--master-port", bind_host, master_port, os.strerror(e.errno)) from None
            self.port = master_port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        if store is not None:  # a worker serves the rendezvous on the master's socket (store_listener)
            self.store, self.store_port = None, store.port
        else:
            import torch.distributed as dist

            # TCPStore alone listens on every interface; hand it a socket bound where we say (loopback locally).
            # The store owns the descriptor from here on (detach): had the Python socket kept it too, collecting
            # this Master would close it under the store, whose destructor then closed the same number again,
            # by then someone else's descriptor (it aborted libzmq in a later test of the same process).
            listener = store_listener(bind_host, store_port)
            self.store = dist.TCPStore(bind_host, listener.port, None, True,
                                       timeout=datetime.timedelta(minutes=30), wait_for_workers=False,
                                       master_listen_fd=listener.detach())
            self.store_port = listener.port
        self.channel = protocol.Channel(secret, run_id, protocol.MASTER)

        self.next_req = 0
        self.futures: dict[tuple[int, int], asyncio.Future] = {}
        self.pending: dict[int, dict[int, RequestRecord]] = {r: {} for r in range(self.n_workers)}
        self.hello: dict[int, protocol.Hello] = {}
        self.last_heartbeat: dict[int, float] = {}
        self.first_heartbeat: dict[int, float] = {}
        self.busy: dict[int, tuple[int, float]] = {}  # rank -> (request its heartbeats report, since when)
        self.hung: set[int] = set()  # workers whose heartbeats stopped: killed at once when the run stops
        # endpoint name -> the socket identity of its first signed message; only that socket is served
        self.routes: dict[str, bytes] = {}
        self.failure: str | None = None
        self.abort: asyncio.Event | None = None  # created inside the event loop
        # Per iteration; an iteration's events go once the next one is finished (nothing can wait on them).
        self.done: dict[int, dict[Node, asyncio.Event]] = {}
        self.data_meta: dict[tuple[str, int], list[protocol.TensorMeta]] = {}
        self.cached: dict[tuple[str, int], dict[int, list[tuple[str, int, int]]]] = {}
        self.pushed: dict[tuple[str, int], list[RequestRecord]] = {}  # (consumer, t) -> its input transfers
        # balance_tokens: t -> sequence -> its tokens (the generation's reply), and each (call, t)'s dp ranges
        self.row_tokens: dict[int, dict[int, int]] = {}
        self.row_ranges: dict[tuple[str, int], tuple[tuple[int, int], ...] | None] = {}
        # ... and by row lists (master_balance.py): (call, t) -> rows per dp rank; (t, setting) -> the dealing
        self.balanced: dict[tuple[str, int], tuple[tuple[int, ...], ...]] = {}
        self.deal_cache: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}
        self.deferred: dict[tuple[str, int], list[str]] = {}  # (train call, t) -> keys whose transfers wait
        # tail migration (master_tail.py): split consumer -> its generation; (call, t) -> rows per dp rank; parts
        self.splits = split_map(program)
        self.row_lists: dict[tuple[str, int], tuple[tuple[int, ...], ...]] = {}
        self.parts: dict[tuple[str, int], ConsumerParts] = {}
        self.known_groups = self._startup_groups()
        self.call_stats: dict[int, dict[str, dict[str, float]]] = {}
        self.node_times: dict[int, dict[str, float]] = {}
        self.remaining: dict[int, int] = {}
        self.iter_end: dict[int, float] = {}  # the last two finished iterations
        self.n_reported = 0
        self.node_hosts: list[str] = []  # host of each plan node, from the workers' hellos
        self.eval_calls = eval_calls(self.spec) if config.eval.every else None
        self.eval_stats: dict[int, dict[str, float]] = {}
        self.samples: dict[int, dict[tuple[str, int], dict[str, Any]]] = {}  # t -> (key, seq) -> merged fields
        self.versions: dict[int, dict[str, int]] = {}  # t -> stale call -> the parameter version it generated with
        self.tasks: set[asyncio.Task] = set()
        self.background: set[asyncio.Task] = set()  # replies no node waits for (_wait_in_background)
        # Created by run(): they stream to the run directory, so a long run keeps a flat memory footprint.
        self.trace: Trace | None = None
        self.requests: RequestLog | None = None
        self.stats: RunStats | None = None
        self.stop_signals = stop_signals
        self.verify_checkpoint = verify_checkpoint
        self.stop: StopRequest | None = None  # set by a stop signal (stop_signals.py)
        self.all_done: asyncio.Event | None = None  # created when the iterations start
        self.last_spawned = -1
        self.longest_save: float | None = None
        self.last_saved: Path | None = None  # this run's newest checkpoint

    async def run(self) -> dict[str, Any]:
        """Connect the workers, set them up, run the iterations, shut down; return the run's summary
        (``RunStats.summary``). Raises RunFailed."""
        self.abort = asyncio.Event()
        cluster = self.spec.cluster
        names = [cluster.device_name(r) for r in range(self.n_workers)]  # node:index, pool by pool
        # A resumed run appends to the earlier sessions' records (dropping their iterations after its checkpoint).
        after = self.start if self.resume is not None else None
        self.trace = Trace(self.paths.trace, self.n_workers, names, t0=time.time(), resume_after=after)
        self.requests = RequestLog(self.paths.root / "requests.jsonl", resume_after=after)
        self.stats = RunStats(self.n_workers)
        for stale in remove_dead_exports(self.paths.root):  # an earlier master's export, killed half way
            log.warning("master: removed %s, the temporary folder of an export that was killed", stale)
        receiver = asyncio.create_task(self._receive())
        monitor = asyncio.create_task(self._monitor())
        refusals = asyncio.create_task(self._log_refused_connections())
        loop = asyncio.get_running_loop()
        restore_signals = self.stop_signals.catch(lambda sig: loop.call_soon_threadsafe(self.request_stop, sig))
        try:
            await self._guard(self._wait_for_workers())
            self.startup.mark("workers")
            if self.secret_file is not None:
                note = remove_secret(self.secret_file)
                if note:
                    log.warning("master: %s", note)
            try:
                self.node_hosts = plan_node_hosts(self.spec.cluster, {r: h.host for r, h in self.hello.items()},
                                                  one_machine=getattr(self.launcher, "one_machine", False))
                self.search_fused_orders()  # before any call, not in the middle of the run (master_fused.py)
            except ValueError as e:
                self.fail(str(e))
                raise RunFailed(self.failure) from None
            self._write_workers_file()
            # the checkpoint the workers load is held for reading: the run that owns it (a peer that this one
            # branches from) neither prunes it nor sets it aside meanwhile (ckpt_lock.py)
            resume = str(self.resume) if self.resume else None
            with reading(Path(self.resume) / checkpoint.META) if self.resume else contextlib.nullcontext():
                setup = self._send(range(self.n_workers), "setup", "setup", -1, "setup",
                                   lambda req: protocol.Setup(req=req, resume=resume,
                                                              total_iterations=self.schedule_iterations,
                                                              verify_checkpoint=self.verify_checkpoint,
                                                              start_iteration=self.start))
                await self._guard(self._wait(setup))
            self.startup.mark("setup")
            if self.on_ready is not None:
                self.on_ready()
            self.t_start = time.time()
            self.stats.start(self.t_start)
            await self._guard(self._run_iterations())
            # A release that no node waited for may still be running, or have failed, on a worker: the run has
            # not gone well until it has replied.
            if self.background:  # asyncio.wait, not gather: a failure elsewhere must not cancel them here
                await self._guard(asyncio.wait(set(self.background)))
            if self.failure is not None:
                raise RunFailed(self.failure)
            if self.exports:
                await self._guard(asyncio.gather(*self.exports))
                await self.prune_after_exports()
            shutdown = self._send(range(self.n_workers), "shutdown", "shutdown", -1, "shutdown",
                                  lambda req: protocol.Shutdown(req=req))
            try:
                await self._guard(asyncio.wait_for(self._wait(shutdown), SHUTDOWN_TIMEOUT))
            except asyncio.TimeoutError:
                raise RunFailed(f"workers did not acknowledge shutdown within {SHUTDOWN_TIMEOUT:.0f} s; they were "
                                f"stopped (training itself finished)") from None
            if self.launcher is not None and not await asyncio.to_thread(self.launcher.wait_exit, 30.0):
                self.launcher.stop()
        except BaseException as e:
            self._abort_workers(str(e) or type(e).__name__)
            if self.launcher is not None:
                self.launcher.stop(grace=KILL_GRACE, hung=self.hung)
            raise
        finally:
            restore_signals()
            for t in (receiver, monitor, refusals, *self.tasks):
                t.cancel()
            # A full or read-only run directory makes these raise: that must neither replace the run's own
            # error nor skip closing the sockets below.
            late = self._close_records()
            await asyncio.sleep(0)  # let the cancelled tasks finish before their sockets close
            self.gate.close(self.sock)
            self.sock.close(linger=500)  # lets abort messages reach the workers
            self.zctx.term()
        if late is not None:  # the run itself went well: the records' last write is the failure
            raise RunFailed(f"the run's records could not be written: {os_error_line(late)}")
        return self.stats.summary()

    def _close_records(self) -> OSError | None:
        """Write the unfinished requests and close requests.jsonl and trace.json; never raises. Returns the
        first OSError (each file is closed even when its last write fails)."""
        first: OSError | None = None
        unfinished = {rec.req: rec for per_rank in self.pending.values() for rec in per_rank.values()}
        steps = [*(lambda r=unfinished[req]: self.requests.write(r) for req in sorted(unfinished)),
                 self.requests.close, self.trace.close]
        for step in steps:
            try:
                step()
            except OSError as e:  # (the run's one error line names the first; the rest follow from it)
                first = first or e
                log.debug("master: %s", os_error_line(e))
        return first

    def request_stop(self, signum: int, source: str = "master") -> None:
        """Stop after the iterations already running, with a checkpoint if one fits in the time left."""
        sig = signal.Signals(signum)
        if self.stop is not None:
            log.warning("master: %s from %s while already stopping", sig.name, source)
            return
        left = self.stop_signals.time_left[sig]
        self.stop = StopRequest(sig, source, time.monotonic() + left)
        if self.all_done is None:
            self.fail(f"stopped by {sig.name} before training started")
            return
        log.warning("master: %s (%s): finishing the iterations in flight, then saving a checkpoint if one fits in "
                    "the %.0f s left", sig.name, source, left)
        self._release_unspawned()
        # A short lead (a warning signal given little time) still gives the calls half of it.
        wait = max(left - STOP_MARGIN, left / 2)
        asyncio.get_running_loop().call_later(wait, self._stop_overdue, wait, left - wait)

    def _stop_overdue(self, waited: float, left: float) -> None:
        """The stop's grace is almost over and the run has not ended: a call is stuck. Fail the run now (the
        workers are killed) rather than wait for the SIGKILL that would leave them behind."""
        stop = self.stop
        if stop is None or self.failure is not None or (self.all_done is not None and self.all_done.is_set()):
            return
        try:
            newest = checkpoint.latest(self.paths.checkpoints, skip_checks=True)
        except OSError:
            newest = None
        stop.note = (f"no new checkpoint was written; the newest is {newest}" if newest is not None
                     else "no checkpoint was written, and the run has none")
        busy = sorted({f"{rec.label} (iteration {rec.iteration + 1})" for per_rank in self.pending.values()
                       for rec in per_rank.values()})
        self.fail(f"stopped by {stop.signal.name}: {', '.join(busy) or 'the iterations in flight'} still running "
                  f"{waited:.0f} s after the signal, {left:.0f} s before the run is killed; "
                  f"{stop.note}")

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            if self.abort is not None:
                self.abort.set()

    async def _guard(self, aw: Any) -> Any:
        """Await ``aw`` unless the run fails first."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.abort.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done and stop not in done:  # both at once: the failure wins
            stop.cancel()
            return task.result()
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: the run's failure is what is reported
        task.cancel()
        raise RunFailed(self.failure or "the run was aborted")

    def _startup_groups(self) -> set[tuple[int, ...]]:
        sets = set(self.program.startup_rank_sets())
        for cl in self.program.all_layouts().values():
            cfg = self.program.model_config(cl.model)
            sets.update(ModelLayout.for_model(cfg, cl.mesh, cl.strategy).rank_sets())
        return sets
