"""The master worker (realhf.txt §3, §6): runs an execution plan on the model workers over ZMQ.

Scheduling. The unrolled dataflow graph is augmented with the nodes the plan implies
(``program.py``): a reallocation wherever consecutive calls of one model use different layouts
(including from the last call of one iteration to the first of the next), offload/reload of
models the plan keeps in host memory, and checkpoint saves. One asyncio coroutine per node waits
for the node's dependencies (data, parameter versions, reallocations), then dispatches its
requests. Calls on disjoint meshes therefore run at the same time, and calls of iteration t+1
start as soon as their own dependencies are met, while iteration t is still finishing elsewhere
(realhf.txt Figure 13). At most ``window`` iterations are in flight.

Messages carry metadata only. The master knows where every piece of data lives (the producer's
layout plus the ranges each device already received) and plans each transfer with the shared
planner, so no device is sent data it holds. A call's outputs are sent to all their consumers as soon
as it finishes (the augmented graph's data-transfer nodes follow their producer), so a transfer never
waits behind work dispatched later on the producer's devices.

Ordering. Every request gets the next number of one global sequence, and is sent to all of its
participants in one synchronous step; workers execute requests in arrival order. So any two
workers execute their common collective steps in the same order and no cycle of waiting can
form. A process group needed by a data plan for the first time is created by a request to every
worker, ordered the same way.

Faults. A worker that exits (local runs poll the processes) or stops sending heartbeats for
``heartbeat_timeout`` seconds, or that reports an error, stops the run: the master kills every
worker and raises ``RunFailed`` naming the worker and the call it was running. So does a worker whose
heartbeats say it has been running one request for over ``call_timeout`` seconds: its heartbeat thread
lives on while the main thread is stuck, e.g. in a collective that another rank never entered (which torch
itself reports only after its own 30-minute timeout) or in an interface function that never returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import zmq
import zmq.asyncio

from realloc.graph.plan import ExecutionPlan
from realloc.models.groups import ModelLayout
from realloc.runtime import checkpoint, protocol
from realloc.runtime.curve import CurveKeys, Gatekeeper, secure_server
from realloc.runtime.data_store import row_bytes
from realloc.runtime.evaluation import eval_calls, eval_key
from realloc.runtime.launcher import RunPaths, WorkerLauncher, plan_node_hosts
from realloc.runtime.program import Realloc, RuntimeProgram
from realloc.runtime.run_config import RunConfig
from realloc.runtime.stop_signals import SAVE_SAFETY, StopRequest, StopSignals, checkpoint_seconds
from realloc.runtime.telemetry import RequestLog, RequestRecord, RunStats, Trace, iteration_metrics
from realloc.runtime.text_io import write_samples
from realloc.runtime.transfer_plan import DataLayout, TransferPlan, dp_ranges, plan_data_transfer

START_TIMEOUT = 600.0  # seconds for every worker to connect (importing megatron takes a while)
SHUTDOWN_TIMEOUT = 60.0
# A hung worker is noticed after HEARTBEAT_TIMEOUT s without a heartbeat, checked every MONITOR_INTERVAL s,
# and killed at once; the others get KILL_GRACE s to exit after the abort message. The run ends within
# about timeout + 1 s.
HEARTBEAT_TIMEOUT = 6.0
CALL_TIMEOUT = 1800.0  # torch's own collective timeout; a run's longest call takes far less
MONITOR_INTERVAL = 0.25
KILL_GRACE = 1.0

log = logging.getLogger("realloc.master")


class RunFailed(Exception):
    """The run stopped: a worker died, hung or failed. The message names the worker and call."""


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str  # call | realloc | offload | reload | save
    name: str  # the call; the model for realloc/offload/reload; "" for save
    t: int
    src: str = ""  # realloc: source call (layout)
    dst: str = ""  # realloc: destination call (layout)

    @property
    def label(self) -> str:
        if self.kind == "call":
            return self.name
        if self.kind == "realloc":
            return f"realloc {self.name}: {self.src}->{self.dst}"
        return f"{self.kind} {self.name}".strip()


class Master:
    def __init__(self, program: RuntimeProgram, config: RunConfig, run: RunPaths, run_id: str, secret: bytes,
                 *, iterations: int, start_iteration: int = 0, resume: Path | None = None, save_every: int = 0,
                 export_every: int = 0,
                 launcher: WorkerLauncher | None = None, bind_host: str = "127.0.0.1", master_port: int = 0,
                 store_port: int = 0, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 call_timeout: float = CALL_TIMEOUT, window: int = 2,
                 stop_signals: StopSignals = StopSignals(), verify_checkpoint: bool = True,
                 schedule_iterations: int | None = None,
                 on_iteration: Callable[[dict[str, Any]], None] | None = None) -> None:
        if iterations < 1:
            raise ValueError(f"iterations must be at least 1, got {iterations}")
        for m, on in program.plan.offload.items():
            if on and program.is_trained(m):
                raise ValueError(f"plan offloads model {m!r}, but it is trained; only frozen models can be "
                                 f"offloaded between calls (its optimizer state never moves)")
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
        self.exports: list[asyncio.Task] = []
        self.model_records = self._model_records()
        self.launcher = launcher
        self.heartbeat_timeout = heartbeat_timeout
        self.call_timeout = call_timeout
        self.window = max(1, window)
        self.on_iteration = on_iteration
        self.n_workers = self.spec.cluster.n_devices
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
            self.sock.bind(f"tcp://{bind_host}:{master_port}")
            self.port = master_port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        # TCPStore alone listens on every interface; hand it a socket bound where we say (loopback locally).
        # The store owns the descriptor from here on (detach): had the Python socket kept it too, collecting
        # this Master would close it under the store, whose destructor then closed the same number again,
        # by then someone else's descriptor (it aborted libzmq in a later test of the same process).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind_host, store_port))
        listener.listen(1024)
        store_port = listener.getsockname()[1]
        self.store = dist.TCPStore(bind_host, store_port, None, True,
                                   timeout=datetime.timedelta(minutes=30), wait_for_workers=False,
                                   master_listen_fd=listener.detach())
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
        self.tasks: set[asyncio.Task] = set()
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

    # -- public ------------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Connect the workers, set them up, run the iterations, shut down; return the run's summary
        (``RunStats.summary``). Raises RunFailed."""
        self.abort = asyncio.Event()
        cluster = self.spec.cluster
        names = [f"{cluster.nodes[cluster.node_of(r)]}:{r % cluster.n_devices_per_node}" for r in range(self.n_workers)]
        self.trace = Trace(self.paths.trace, self.n_workers, names, t0=time.time())
        self.requests = RequestLog(self.paths.root / "requests.jsonl")
        self.stats = RunStats(self.n_workers)
        receiver = asyncio.create_task(self._receive())
        monitor = asyncio.create_task(self._monitor())
        refusals = asyncio.create_task(self._log_refused_connections())
        loop = asyncio.get_running_loop()
        restore_signals = self.stop_signals.catch(lambda sig: loop.call_soon_threadsafe(self.request_stop, sig))
        try:
            await self._guard(self._wait_for_workers())
            try:
                self.node_hosts = plan_node_hosts(self.spec.cluster, {r: h.host for r, h in self.hello.items()})
            except ValueError as e:
                self.fail(str(e))
                raise RunFailed(self.failure) from None
            self._write_workers_file()
            setup = self._send(range(self.n_workers), "setup", "setup", -1, "setup",
                               lambda req: protocol.Setup(req=req, resume=str(self.resume) if self.resume else None,
                                                          total_iterations=self.schedule_iterations,
                                                          verify_checkpoint=self.verify_checkpoint))
            await self._guard(self._wait(setup))
            self.t_start = time.time()
            self.stats.start(self.t_start)
            await self._guard(self._run_iterations())
            if self.exports:
                await self._guard(asyncio.gather(*self.exports))
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
            unfinished = {rec.req: rec for per_rank in self.pending.values() for rec in per_rank.values()}
            for req in sorted(unfinished):
                self.requests.write(unfinished[req])
            self.requests.close()
            self.trace.close()
            await asyncio.sleep(0)  # let the cancelled tasks finish before their sockets close
            self.gate.close(self.sock)
            self.sock.close(linger=500)  # lets abort messages reach the workers
            self.zctx.term()
        return self.stats.summary()

    def _write_workers_file(self) -> None:
        info = {"master_port": self.port, "store_port": self.store.port,
                "nodes": {f"{i} ({self.spec.cluster.nodes[i]})": h for i, h in enumerate(self.node_hosts)},
                "workers": {str(r): {"pid": h.pid, "host": h.host} for r, h in sorted(self.hello.items())}}
        tmp = self.paths.root / "workers.json.part"
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(self.paths.root / "workers.json")

    def _abort_workers(self, reason: str) -> None:
        """Tell every worker's heartbeat thread to exit: workers stuck in a collective cannot read requests."""
        for r in range(self.n_workers):
            name = protocol.heartbeat_name(r)
            if name not in self.routes:
                continue  # never connected
            try:
                sent = self.sock.send_multipart([self.routes[name], *self.channel.pack(name, protocol.Abort(reason=reason))],
                                                flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                continue  # never connected or already gone
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # a dead peer's error is expected

    # -- stopping on a signal (stop_signals.py) -------------------------------------------------------------------
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

    async def _stop_after(self, t: int) -> None:
        """The stop's last step after iteration ``t``: a checkpoint if there is time, then the end of the run."""
        stop = self.stop
        assert stop is not None and self.all_done is not None
        stop.after_iteration = t + 1
        try:
            name = self.paths.checkpoints / checkpoint.checkpoint_name(t + 1)
            if self._saves_after(t):
                stop.checkpoint = str(name)  # the plan's own save of this iteration
            else:
                need = checkpoint_seconds(self.program, self.n_workers, self.longest_save)
                left = stop.deadline - time.monotonic()
                if SAVE_SAFETY * need <= left:
                    await self._save(t)
                    stop.checkpoint = str(name)
                else:
                    stop.note = (f"no checkpoint: one takes about {need:.1f} s and {max(left, 0.0):.1f} s were left; "
                                 f"the newest is in {self.paths.checkpoints}")
        except RunFailed:
            pass  # recorded; run() raises it
        finally:
            self.all_done.set()

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            if self.abort is not None:
                self.abort.set()

    # -- plumbing -----------------------------------------------------------------------------------------------
    async def _guard(self, aw: Any) -> Any:
        """Await ``aw`` unless the run fails first."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.abort.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            stop.cancel()
            return task.result()
        task.cancel()
        raise RunFailed(self.failure or "the run was aborted")

    def _startup_groups(self) -> set[tuple[int, ...]]:
        sets = set(self.program.startup_rank_sets())
        for cl in self.program.all_layouts().values():
            cfg = self.program.model_config(cl.model)
            sets.update(ModelLayout.for_model(cfg, cl.mesh, cl.strategy).rank_sets())
        return sets

    def _send(self, ranks: Any, kind: str, label: str, iteration: int, node: str,
              make: Callable[[int], protocol._Msg]) -> RequestRecord:
        """Number a request and send it to all ``ranks`` without yielding, so per-worker order = number order."""
        req = self.next_req
        self.next_req += 1
        ranks = tuple(sorted(ranks))
        rec = RequestRecord(req=req, kind=kind, label=label, iteration=iteration, node=node, dispatched=time.time(),
                            ranks=ranks)
        body = make(req)
        loop = asyncio.get_running_loop()
        for r in ranks:
            self.futures[req, r] = loop.create_future()
            self.pending[r][req] = rec
            # pyzmq queues sends in call order, so nothing can overtake this request on the way to worker r.
            name = protocol.worker_name(r)
            sent = self.sock.send_multipart([self.routes[name], *self.channel.pack(name, body)])
            sent.add_done_callback(lambda f, r=r: self._check_sent(f, r))
        return rec

    def _check_sent(self, f: asyncio.Future, rank: int) -> None:
        if not f.cancelled() and f.exception() is not None:
            self._worker_gone(rank, f"is unreachable ({f.exception()})")

    def _worker_gone(self, rank: int, why: str, request: int | None = None) -> None:
        """Fail the run naming the worker, how it went away and what it was doing."""
        code = self.launcher.dead().get(rank) if self.launcher is not None else None
        if code is not None:
            why = f"(pid {self.launcher.pid(rank)}) exited with code {code}"
        self.fail(f"worker {rank} {why} {self._running_on(rank, request)}; see {self.paths.worker_log(rank)}")

    async def _wait(self, rec: RequestRecord) -> list[protocol.Reply]:
        keys = [(rec.req, r) for r in rec.ranks]
        replies = await asyncio.gather(*(self.futures[k] for k in keys))
        for k in keys:
            del self.futures[k]
        rec.completed = time.time()
        for rep in replies:
            rec.spans[rep.rank] = (rep.start, rep.end)
        self.trace.add(rec)
        self.requests.write(rec)
        bad = next((rep for rep in replies if not rep.ok), None)
        if bad is not None:
            it = f" (iteration {rec.iteration + 1})" if rec.iteration >= 0 else ""
            where = f"call {rec.label}{it}" if rec.kind == "call" else f"{rec.label}{it}"
            self.fail(f"worker {bad.rank} failed in {where}: {bad.error}; see {self.paths.worker_log(bad.rank)}")
            raise RunFailed(self.failure)
        return replies

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                self._handle_incoming(frames)
            except Exception as e:  # noqa: BLE001 - a bug here must stop the run, not leave it hanging
                self.fail(f"master error while handling a worker message: {type(e).__name__}: {e}")

    async def _log_refused_connections(self) -> None:
        while True:
            self.gate.on_event(await self.gate.monitor.recv_multipart())

    def _handle_incoming(self, frames: list[bytes]) -> None:
        ident, name = frames[0], protocol.endpoint_name(frames[0])
        env = self.channel.try_unpack(frames[1:], expect_src=name)
        if env is None:
            return
        body = env.body
        rank = getattr(body, "rank", None)
        if not isinstance(rank, int) or not 0 <= rank < self.n_workers:
            log.warning("master: dropped a %s from %r naming rank %r outside 0..%d", body.type, name, rank,
                        self.n_workers - 1)
            return
        expected = protocol.heartbeat_name(rank) if isinstance(body, protocol.Heartbeat) else protocol.worker_name(rank)
        if name != expected:
            log.warning("master: dropped a %s for rank %d from %r", body.type, rank, name)
            return
        # The first signed message binds the name to its socket: a second socket (a restarted worker
        # with the secret, or a replay through another connection) is never served.
        bound = self.routes.setdefault(name, ident)
        if bound != ident:
            log.warning("master: dropped a %s from a second connection claiming %r", body.type, name)
            return
        if isinstance(body, protocol.Heartbeat):
            if body.stop_signal in self.stop_signals.time_left and self.stop is None:
                self.request_stop(body.stop_signal, f"worker {rank}")
            now = time.monotonic()
            self.last_heartbeat[rank] = now
            self.first_heartbeat.setdefault(rank, now)
            if self.busy.get(rank, (-1, 0.0))[0] != body.busy_req:
                self.busy[rank] = (body.busy_req, now)
            self.sock.send_multipart([ident, *self.channel.pack(name, protocol.Heartbeat(rank=-1))])
        elif isinstance(body, protocol.Hello):
            self.hello[rank] = body
            self.last_heartbeat.setdefault(rank, time.monotonic())
        elif isinstance(body, protocol.Reply):
            fut = self.futures.get((body.req, rank))
            rec = self.pending[rank].pop(body.req, None)
            if rec is not None:
                rec.received[rank] = time.time()
                self.stats.on_reply(rec.kind, rank, rec.dispatched, body.start, body.end, rec.received[rank])
            if fut is not None and not fut.done():
                fut.set_result(body)
        else:
            log.warning("master: dropped an unexpected %s from %r", body.type, ident)

    def _running_on(self, rank: int, request: int | None = None) -> str:
        if not self.pending[rank]:
            return "while idle"
        rec = self.pending[rank].get(request) or self.pending[rank][min(self.pending[rank])]
        it = f" of iteration {rec.iteration + 1}" if rec.iteration >= 0 else ""
        return f"while running {rec.kind} {rec.label!r}{it}"

    async def _monitor(self) -> None:
        checked = time.monotonic()
        while True:
            await asyncio.sleep(MONITOR_INTERVAL)
            if self.launcher is not None:
                for r in sorted(self.launcher.dead()):
                    self._worker_gone(r, "exited")
            now = time.monotonic()
            if now - checked > MONITOR_INTERVAL + 1.0:
                # This loop itself stalled: heartbeats may be waiting unread; judge them next round.
                checked = now
                continue
            checked = now
            for r, last in sorted(self.last_heartbeat.items()):
                if now - last > self.heartbeat_timeout:
                    self.hung.add(r)
                    self._worker_gone(r, f"stopped responding (no heartbeat for {now - last:.0f} s)")
            # The longest-stuck worker is the likely cause: the others may only wait in collectives with it.
            stuck = sorted((since, r, req) for r, (req, since) in self.busy.items()
                           if req >= 0 and now - since > self.call_timeout)
            if stuck:
                since, r, req = stuck[0]
                self.hung.add(r)
                self._worker_gone(r, f"has run one request for {now - since:.1f} s, longer than the call timeout "
                                     f"of {self.call_timeout:g} s (--call-timeout; stuck, e.g. in a collective "
                                     f"another rank never entered)", request=req)

    async def _wait_for_workers(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while len(self.hello) < self.n_workers:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.n_workers)) - set(self.hello))
                self.fail(f"workers {missing} did not connect within {START_TIMEOUT:.0f} s; see {self.paths.logs}")
                raise RunFailed(self.failure)
            # A worker's hello follows its first heartbeat within milliseconds; heartbeats alone mean
            # its request socket never got through.
            now = time.monotonic()
            stuck = [r for r, t in sorted(self.first_heartbeat.items())
                     if r not in self.hello and now - t > self.heartbeat_timeout]
            if stuck:
                self.fail(f"worker {stuck[0]} sends heartbeats but its hello has not arrived for "
                          f"{self.heartbeat_timeout:.0f} s: its request socket cannot reach the master; see "
                          f"{self.paths.worker_log(stuck[0])}")
                raise RunFailed(self.failure)
            await asyncio.sleep(0.05)

    # -- the augmented, unrolled graph ---------------------------------------------------------------------------
    def _saves_after(self, t: int) -> bool:
        return self._every(self.save_every, t) or self._every(self.export_every, t)

    def _every(self, n: int, t: int) -> bool:
        return n > 0 and ((t + 1) % n == 0 or t == self.end - 1)

    def _model_records(self) -> dict[str, dict[str, Any]]:
        """meta.json's description of each trained model, so that `realloc export` needs only the checkpoint."""
        from realloc.data.tokenizer import Tokenizer
        from realloc.runtime.export import model_record
        from realloc.runtime.text_io import SpecialTokens

        prog, cfg = self.program, self.config
        tokenizer = Tokenizer.load(cfg.tokenizer) if cfg.tokenizer else None
        ids = SpecialTokens.of(self.spec, tokenizer).hf_ids()
        out = {}
        for m in prog.models:
            if prog.is_trained(m):
                src = self.spec.models.get(m)
                out[m] = model_record(prog.model_config(m), prog.calls[prog.home_call(m)].strategy,
                                      src.path if src else None, cfg.tokenizer, ids)
        return out

    def _realloc_into(self, call: str) -> Realloc | None:
        m = self.program.calls[call].model
        seg = next(s for s in self.program.segments(m) if call in s.calls)
        return next((r for r in self.program.reallocs(m) if r.dst_call == seg.calls[0]), None)

    def _nodes(self, t: int) -> list[Node]:
        prog = self.program
        nodes = [Node("call", c, t) for c in self.graph.topo_order]
        for m in prog.models:
            nodes += [Node("realloc", m, t, r.src_call, r.dst_call) for r in prog.reallocs(m)]
            if m in self.offloaded:
                nodes.append(Node("offload", m, t))
                if t > self.start:
                    nodes.append(Node("reload", m, t))
        if self._evaluates(t):
            nodes += [Node("eval", "generate", t), Node("eval", "reward", t)]
        if self._saves_after(t):
            nodes.append(Node("save", "", t))
        return nodes

    def _evaluates(self, t: int) -> bool:
        return self.eval_calls is not None and self.config.eval.due(t)

    def _deps(self, n: Node) -> list[Node]:
        prog, t = self.program, n.t
        out: list[Node] = []
        if n.kind in ("call", "realloc"):
            model = prog.calls[n.name].model if n.kind == "call" else n.name
            if model in self.offloaded and t > self.start:
                out.append(Node("reload", model, t))
            if t > self.start and self._saves_after(t - 1):
                out.append(Node("save", "", t - 1))
        if n.kind == "call":
            out += [Node("call", u, t) for u in self.graph.graph.predecessors(n.name)]
            if t > self.start:
                out += [Node("call", u, t - 1) for u, v in self.graph.carry_edges if v == n.name]
            r = self._realloc_into(n.name)
            if r is not None:
                out.append(Node("realloc", r.model, t, r.src_call, r.dst_call))
        elif n.kind == "realloc":
            r = next(x for x in prog.reallocs(n.name) if (x.src_call, x.dst_call) == (n.src, n.dst))
            tt = t - 1 if r.wraps else t
            if tt >= self.start:
                out += [Node("call", c, tt) for c in r.after]
        elif n.kind == "offload":
            out += [Node("call", c, t) for c in prog.chain_calls(n.name)]
            out += [Node("realloc", n.name, t, r.src_call, r.dst_call) for r in prog.reallocs(n.name)]
        elif n.kind == "reload":
            out.append(Node("offload", n.name, t - 1))
        elif n.kind == "save":
            out += [x for x in self._nodes(t) if x.kind != "save"]
        elif n.kind == "eval":
            ec = self.eval_calls
            out += ([Node("call", ec.train, t)] if n.name == "generate" else
                    [Node("eval", "generate", t), Node("call", ec.reward, t)])
            return out
        # An evaluation runs in the layouts of the actor's train step and of the reward call, right after
        # them: what moves their parameters (reallocation, offload) or changes them (a later iteration)
        # waits for it too. The same iteration's consumers of the reward do not: the evaluation waits for
        # the actor's train step, which needs them.
        anchors = {self.eval_calls.train: "generate", self.eval_calls.reward: "reward"} if self.eval_calls else {}
        out += [Node("eval", anchors[d.name], d.t) for d in list(out)
                if d.kind == "call" and d.name in anchors and self._evaluates(d.t)
                and (n.kind in ("realloc", "offload") or d.t < n.t)]
        return out

    async def _run_iterations(self) -> None:
        first = min(self.end, self.start + self.window)
        self.all_done = asyncio.Event()
        for t in range(self.start, first):
            self._spawn(t)
        await self.all_done.wait()

    def _spawn(self, t: int) -> None:
        self.last_spawned = t
        nodes = self._nodes(t)
        self.remaining[t] = len(nodes)
        self.call_stats[t] = {}
        self.node_times[t] = {}
        self.done[t] = {n: asyncio.Event() for n in nodes}
        for n in nodes:
            self._task(self._node(n))

    async def _node(self, n: Node) -> None:
        try:
            for d in self._deps(n):
                if d.t >= self.start:
                    await self.done[d.t][d].wait()
            t0 = time.time()
            if n.kind == "call":
                await self._call(n)
            elif n.kind == "realloc":
                rec = self._send(self._realloc_ranks(n), "realloc", n.label, n.t, n.label,
                                 lambda req: protocol.Reallocate(req=req, model=n.name, src_call=n.src,
                                                                 dst_call=n.dst, iteration=n.t))
                await self._wait(rec)
            elif n.kind in ("offload", "reload"):
                home = self.program.home_call(n.name)
                rec = self._send(self.program.calls[home].ranks, n.kind, n.label, n.t, n.label,
                                 lambda req: protocol.Offload(req=req, model=n.name, call=home,
                                                              to_host=n.kind == "offload", iteration=n.t))
                await self._wait(rec)
            elif n.kind == "save":
                await self._save(n.t)
            elif n.kind == "eval":
                await self._eval(n)
            t1 = time.time()
            self.trace.add_node(n.label, n.kind, n.t, t0, t1)
            key = n.name if n.kind == "call" else n.kind
            self.node_times[n.t][key] = self.node_times[n.t].get(key, 0.0) + (t1 - t0)
            self.done[n.t][n].set()
            self._finished(n.t)
        except RunFailed:
            pass  # already recorded; run() raises it
        except Exception as e:  # noqa: BLE001 - a bug here must stop the run, not hang it
            self.fail(f"master error in {n.label} (iteration {n.t + 1}): {type(e).__name__}: {e}")

    def _realloc_ranks(self, n: Node) -> list[int]:
        return sorted(set(self.program.calls[n.src].ranks) | set(self.program.calls[n.dst].ranks))

    def _finished(self, t: int) -> None:
        self.remaining[t] -= 1
        if self.remaining[t]:
            return
        self.iter_end[t] = time.time()
        # Report iterations in order.
        while (k := self.start + self.n_reported) in self.iter_end:
            begin = self.iter_end.get(k - 1, self.t_start)
            # Iteration k finishes before k - 1 when k - 1's evaluation overlaps k's calls; for the report it
            # ends when both have (its time is then 0), so iteration times stay >= 0 and sum to the wall time.
            self.iter_end[k] = max(self.iter_end[k], begin)
            m = iteration_metrics(k, self.call_stats.pop(k), self.node_times.pop(k), self.iter_end[k] - begin,
                                  self.program.batch_size * self.spec.seq_len, self.graph.headline_calls)
            if k in self.eval_stats:
                ev = self.eval_stats.pop(k)
                m["eval"] = {"reward": ev["score_sum"] / ev["n_seqs_scored"], "n": int(ev["n_seqs_scored"]),
                             "greedy": self.config.eval.greedy}
            self.n_reported += 1
            self.stats.on_iteration(m, self.iter_end[k])
            with open(self.paths.metrics, "a") as f:
                f.write(json.dumps(m) + "\n")
            write_samples(self.paths.root, k, self.samples.pop(k, {}))
            self.trace.flush()
            self.requests.flush()
            if self.on_iteration is not None:
                self.on_iteration(m)
            del self.remaining[k]
            self.iter_end.pop(k - 1, None)
            self.done.pop(k - 1, None)  # iteration k + 1 waits only on iteration k
            rel = self._send(range(self.n_workers), "release", "release data", k, "release",
                             lambda req, k=k: protocol.ReleaseData(req=req, before_iteration=k + 1))
            self._task(self._wait_quietly(rel))
            for c in list(self.cached):
                if c[1] <= k:
                    self.cached.pop(c, None)
                    self.data_meta.pop(c, None)
            nxt = k + self.window
            if nxt < self.end and self.stop is None:
                self._spawn(nxt)
            if self.stop is not None and k == self.last_spawned:
                self.stats.close()
                self._task(self._stop_after(k))
            elif k == self.end - 1:
                self.stats.close()
                self.all_done.set()

    def _task(self, coro: Any) -> None:
        """Run ``coro`` as a task the master cancels at the end; it forgets the task when it finishes."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _wait_quietly(self, rec: RequestRecord) -> None:
        try:
            await self._wait(rec)
        except RunFailed:
            pass

    # -- node bodies -------------------------------------------------------------------------------------------------
    async def _call(self, n: Node) -> None:
        c, t = n.name, n.t
        rpc = self.graph.call(c)
        # The inputs were sent when their producers finished (``_push_outputs``); each worker runs them
        # before this call, which it received later.
        recs = self.pushed.pop((c, t), [])
        call = self._send(self.program.calls[c].ranks, "call", c, t, c,
                          lambda req: protocol.RunCall(req=req, call=c, iteration=t))
        for rec in recs:
            await self._wait(rec)
        replies = await self._wait(call)
        stats: dict[str, float] = {}
        for rep in replies:
            for k, v in rep.stats.items():
                stats[k] = stats.get(k, 0.0) + v
            for out in rep.outputs:
                self.data_meta.setdefault((out.key, t), out.tensors)
            for part in rep.samples:
                self.samples.setdefault(t, {}).setdefault((part.key, part.seq), {}).update(part.fields)
        missing = [k for k in rpc.output_data if (k, t) not in self.data_meta]
        if missing:
            self.fail(f"call {c} (iteration {t + 1}) produced no data for key {missing[0]!r}")
            raise RunFailed(self.failure)
        self.call_stats[t][c] = stats
        self._push_outputs(c, t)

    def _push_outputs(self, producer: str, t: int) -> None:
        """Dispatch the transfers of ``producer``'s outputs to every consumer now, in topological order.

        A data-transfer node follows its producer in the augmented graph (realhf.txt §4), which is how the
        planner's simulator schedules it. Sent later, with the consumer, a transfer queues behind work
        dispatched in between on the producer's devices, and the consumer's devices wait idle in it.
        """
        produced = set(self.graph.call(producer).output_data)
        for consumer in self.graph.topo_order:
            for key in self.graph.call(consumer).input_data:
                if key in produced:
                    self.pushed.setdefault((consumer, t), []).extend(self._transfer(key, consumer, t))

    def _transfer(self, key: str, consumer: str, t: int) -> list[RequestRecord]:
        metas = self.data_meta[(key, t)]
        cached = self.cached.setdefault((key, t), {})
        plan = self.program.data_plan(key, consumer, row_bytes(metas), cached={d: list(v) for d, v in cached.items()})
        dl = self.program.consumer(consumer)
        ranges = dp_ranges(self.program.batch_size, dl.strategy.dp)
        for dev, (dp_rank, _, pp_rank) in dl.layout.coords_by_device.items():
            entry = (key, *ranges[dp_rank])
            if entry not in cached.setdefault(dev, []):
                cached[dev].append(entry)
        return self._send_transfer(key, consumer, t, plan, metas)

    def _send_transfer(self, key: str, consumer: str, t: int, plan: TransferPlan,
                       metas: list[protocol.TensorMeta]) -> list[RequestRecord]:
        if not plan.transfers:
            return []
        recs = []
        new = sorted(set(plan.groups) - self.known_groups)
        if new:
            recs.append(self._send(range(self.n_workers), "groups", "create groups", t, consumer,
                                   lambda req: protocol.EnsureGroups(req=req, rank_sets=[list(g) for g in new])))
            self.known_groups.update(new)
        ranks = sorted({x.src for x in plan.transfers} | {d for x in plan.transfers for d in x.dsts})
        pieces = [protocol.Broadcast(src=x.src, dsts=list(x.dsts), lo=x.lo, hi=x.hi) for x in plan.transfers]
        recs.append(self._send(ranks, "data", f"{key} -> {consumer}", t, consumer,
                               lambda req: protocol.TransferData(req=req, key=key, iteration=t, dst_call=consumer,
                                                                 tensors=metas, broadcasts=pieces)))
        return recs

    async def _eval(self, n: Node) -> None:
        """An evaluation pass (``evaluation.py``): generate on the eval batches at the actor's home, then
        move the sequences to the reward call and score them."""
        ec, t, prog = self.eval_calls, n.t, self.program
        seq_key = self.graph.call(ec.generate).output_data[0]
        for j in range(self.config.eval.batches):
            if n.name == "generate":
                rec = self._send(prog.calls[ec.train].ranks, "eval", f"eval generate {j}", t, n.label,
                                 lambda req, j=j: protocol.RunCall(req=req, call=ec.generate, iteration=t,
                                                                   eval_batch=j, layout_call=ec.train))
                for rep in await self._wait(rec):
                    for out in rep.outputs:
                        self.data_meta.setdefault((out.key, t), out.tensors)
                continue
            key = eval_key(j, seq_key)
            metas = self.data_meta.pop((key, t))
            home = prog.calls[ec.train]
            plan = plan_data_transfer({key: [row_bytes(metas)] * prog.batch_size},
                                      DataLayout(home.mesh, home.strategy, tuple(range(home.strategy.pp))),
                                      prog.consumer(ec.reward))
            moves = self._send_transfer(key, ec.reward, t, plan, metas)
            rec = self._send(prog.calls[ec.reward].ranks, "eval", f"eval reward {j}", t, n.label,
                             lambda req, j=j: protocol.RunCall(req=req, call=ec.reward, iteration=t, eval_batch=j))
            for m in moves:
                await self._wait(m)
            stats = self.eval_stats.setdefault(t, {})
            for rep in await self._wait(rec):
                for k, v in rep.stats.items():
                    stats[k] = stats.get(k, 0.0) + v
        if n.name == "reward":  # the other outputs of the eval generation (logp) are not needed
            for k in [k for k in self.data_meta if k[1] == t and k[0].startswith("eval")]:
                self.data_meta.pop(k)

    async def _save(self, t: int) -> None:
        # Named after the iterations it holds: iter_00000010 is the state after iteration 10 (t = 9).
        began = time.monotonic()
        done = t + 1
        tmp = checkpoint.begin(self.paths.checkpoints, done)
        rec = self._send(range(self.n_workers), "save", f"checkpoint {done}", t, "save",
                         lambda req: protocol.SaveCheckpoint(req=req, directory=str(tmp), iteration=t))
        await self._wait(rec)
        prog = self.program
        layouts = {m: f"{prog.calls[prog.home_call(m)].mesh.name} {prog.calls[prog.home_call(m)].strategy}"
                   for m in prog.models if prog.is_trained(m)}
        meta = {"next_iteration": done, "prompts_consumed": done * prog.batch_size, "seed": self.config.seed,
                "experiment": self.spec.name, "graph_digest": self.graph.digest, "run_id": self.run_id,
                "layouts": layouts, "models": self.model_records, "schedule_iterations": self.schedule_iterations}
        final = await asyncio.to_thread(checkpoint.commit, tmp, self.paths.checkpoints, done, meta,
                                        prog.plan.to_json())
        self.longest_save = max(self.longest_save or 0.0, time.monotonic() - began)
        if self._every(self.export_every, t):
            # The export reads the committed checkpoint on a thread while training goes on.
            self.exports.append(asyncio.create_task(asyncio.to_thread(self._export, final, done)))

    def _export(self, ckpt: Path, done: int) -> None:
        from realloc.runtime.export import export_checkpoint

        for m in self.model_records:
            out = self.paths.root / "exports" / checkpoint.checkpoint_name(done) / m
            export_checkpoint(ckpt, m, out)
            log.info("exported %s after iteration %d to %s", m, done, out)


def plan_from_checkpoint(ckpt: Path) -> ExecutionPlan:
    return ExecutionPlan.load(ckpt / "plan.json")
