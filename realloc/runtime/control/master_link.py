"""The master's link to its workers: numbered requests out, replies and heartbeats in, liveness.

``MasterLink`` is one part of ``Master`` (``master.py``), which creates the state these methods share.

Ordering. Every request gets the next number of one global sequence, and is sent to all of its
participants in one synchronous step; workers execute requests in arrival order. So any two
workers execute their common collective steps in the same order and no cycle of waiting can
form.

Faults. A worker that exits (local runs poll the processes) or stops sending heartbeats for
``heartbeat_timeout`` seconds, or that reports an error, stops the run: the master kills every
worker and raises ``RunFailed`` naming the worker and the call it was running. So does a worker whose
heartbeats say it has been running one request for over ``call_timeout`` seconds: its heartbeat thread
lives on while the main thread is stuck, e.g. in a collective that another rank never entered (which torch
itself reports only after its own 30-minute timeout) or in an interface function that never returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Iterable, Protocol

import zmq

from realloc.cluster import ClusterSpec
from realloc.runtime.records.startup import WorkerStart
from realloc.runtime.records.telemetry import RequestRecord
from realloc.runtime.wire import protocol

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


class WorkerLauncher(Protocol):
    """What the master needs of a launcher: who is gone, and how to stop the rest."""

    def pid(self, rank: int) -> int | None: ...

    def dead(self) -> dict[int, int]: ...

    def stop(self, grace: float = 5.0, hung: Iterable[int] = ()) -> None: ...

    def wait_exit(self, timeout: float) -> bool: ...


def plan_node_hosts(cluster: ClusterSpec, hosts: dict[int, str], one_machine: bool = False) -> list[str]:
    """The host each node of the plan landed on, from the workers' own host names.

    Plans name nodes by index and launchers place rank r on node r // devices_per_node; check that they
    did: a node's devices on one host, and (for GPUs) distinct nodes on distinct hosts, or the plan's
    intra-node bandwidth would be a fiction. CPU clusters may simulate several nodes on one host, and so may
    GPU clusters under the local launcher (``one_machine``: one GPU of this machine per rank, issue 32's pools).
    """
    out = []
    for i in range(cluster.n_nodes):
        ranks = [r for r in range(cluster.n_devices) if cluster.node_of(r) == i]  # a block (pools: per pool's size)
        seen = sorted({hosts[r] for r in ranks if r in hosts})
        if len(seen) > 1:
            raise ValueError(f"plan node {i} ({cluster.nodes[i]}) should be one machine, but its ranks "
                             f"{ranks[0]}..{ranks[-1]} run on {', '.join(seen)}; the launcher must place ranks in "
                             f"blocks of {len(ranks)} per node (srun --distribution=block)")
        out.append(seen[0] if seen else "?")
    if cluster.hardware.kind != "cpu" and not one_machine and len(set(out)) < len(out):
        shared = sorted({h for h in out if out.count(h) > 1})
        raise ValueError(f"plan nodes {[i for i, h in enumerate(out) if h in shared]} all run on {', '.join(shared)}; "
                         f"each node of the plan needs a machine of its own")
    return out


class MasterLink:
    """Requests, replies, heartbeats and the checks that a worker is still there (a part of ``Master``)."""

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

    def _write_workers_file(self) -> None:
        info = {"master_port": self.port, "store_port": self.store_port,
                "nodes": {f"{i} ({self.spec.cluster.nodes[i]})": h for i, h in enumerate(self.node_hosts)},
                "workers": {str(r): {"pid": h.pid, "host": h.host} for r, h in sorted(self.hello.items())}}
        tmp = self.paths.root / "workers.json.part"
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(self.paths.root / "workers.json")

    def _send(self, ranks: Any, kind: str, label: str, iteration: int, node: str,
              make: Callable[[int], protocol._Msg]) -> RequestRecord:
        """Number a request and send it to all ``ranks`` without yielding, so per-worker order = number order."""
        req = self.next_req
        self.next_req += 1
        ranks = tuple(sorted(ranks))
        rec = RequestRecord(req=req, kind=kind, label=label, iteration=iteration, node=node, dispatched=time.time(),
                            ranks=ranks)
        if kind == "call":
            self.startup.mark("first_call", rec.dispatched)  # (only the first counts; requests.jsonl's time)
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

    def _dead_peer(self, rank: int) -> int | None:
        """Another worker that has exited with a failure code, if any: a worker killed mid-collective makes its peers
        fail with a connection error before the master sees the exit, and the exit is the run's real cause."""
        dead = self.launcher.dead() if self.launcher is not None else {}
        return min((r for r, code in dead.items() if r != rank and code), default=None)

    async def _wait(self, rec: RequestRecord) -> list[protocol.Reply]:
        keys = [(rec.req, r) for r in rec.ranks]
        replies = await asyncio.gather(*(self.futures[k] for k in keys))
        for k in keys:
            del self.futures[k]
        rec.completed = time.time()
        for rep in replies:
            rec.spans[rep.rank] = (rep.start, rep.end)
            if rep.memory:
                rec.memory[rep.rank] = dict(rep.memory)
        self.trace.add(rec)
        self.requests.write(rec)
        bad = next((rep for rep in replies if not rep.ok), None)
        if bad is not None:
            it = f" (iteration {rec.iteration + 1})" if rec.iteration >= 0 else ""
            if rec.kind == "save":  # the label names it: "checkpoint 4 could not be written: worker 0: OSError: ..."
                self.fail(f"{rec.label} could not be written: worker {bad.rank}: {bad.error}; see "
                          f"{self.paths.worker_log(bad.rank)}")
                raise RunFailed(self.failure)
            dead = self._dead_peer(bad.rank)
            if dead is not None:  # a peer's collective broke because that worker died: name the cause, not the echo
                self._worker_gone(dead, "exited")
                raise RunFailed(self.failure)
            where = f"call {rec.label}{it}" if rec.kind == "call" else f"{rec.label}{it}"
            self.fail(f"worker {bad.rank} failed in {where}: {bad.error}; see {self.paths.worker_log(bad.rank)}")
            raise RunFailed(self.failure)
        return replies

    async def _wait_quietly(self, rec: RequestRecord) -> None:
        try:
            await self._wait(rec)
        except RunFailed:
            pass

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
        # Replay counters are kept per connection (``peer``): a message that another connection claiming this
        # name gets through verification, and that the checks below then drop, cannot move the real worker's
        # counter (its next messages would look replayed: a false heartbeat timeout, or replies never read).
        env = self.channel.try_unpack(frames[1:], expect_src=name, peer=ident)
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
            self.startup.workers[rank] = WorkerStart(rank, body.started, body.imported, body.ready)
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
