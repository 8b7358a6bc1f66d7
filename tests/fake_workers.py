"""Threads that play a run's model workers over the real wire protocol (CURVE + signed messages), so a
``Master`` can be driven through many iterations in a second, without torch work.

Each rank answers every request at once with success. A call's reply carries a one-float tensor per output
key of the call (what the master needs to plan the transfers), plus any sample-log parts ``samples(call,
iteration, rank)`` returns. ``delays`` (request type -> seconds) makes some requests slow, e.g. saves;
``held(request, rank)`` -> seconds holds a request's reply that long while the rank answers later requests
(replies out of order, as a master on slow links or busy devices can see them). ``reply_stats(request, rank)``
adds stats to a reply (e.g. the parameter version a generation reports under bounded staleness); ``fails(request,
rank)`` -> an error message makes that reply a failure.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
from typing import Any, Callable

import zmq

from realloc.runtime.inputs.evaluation import eval_key
from realloc.runtime.wire import protocol
from realloc.runtime.wire.curve import CurveKeys, secure_client

SampleParts = Callable[[str, int, int], list[protocol.SamplePart]]
Held = Callable[[Any, int], float]  # (request message, rank) -> seconds


class FakeWorkers:
    def __init__(self, endpoint: str, secret: bytes, run_id: str, n_workers: int, outputs: dict[str, list[str]],
                 samples: SampleParts = lambda call, t, rank: [], delays: dict[str, float] | None = None,
                 held: Held = lambda req, rank: 0.0,
                 reply_stats: Callable[[Any, int], dict[str, float]] = lambda req, rank: {},
                 fails: Callable[[Any, int], str] = lambda req, rank: "") -> None:
        self.ctx = zmq.Context()
        self.delays = delays or {}
        self.held = held
        self.outputs = outputs
        self.samples = samples
        self.reply_stats = reply_stats  # (request, rank) -> extra stats of the reply (answered in order per rank)
        self.fails = fails  # (request, rank) -> an error: the rank replies ok=False with it ("" answers ok)
        self.requests: list[str] = []  # kinds received by rank 0, in order
        self.closing = threading.Event()  # set on leaving the with block: a failed run sends no shutdown
        self.threads = [threading.Thread(target=self._serve, args=(endpoint, secret, run_id, r), daemon=True)
                        for r in range(n_workers)]

    def __enter__(self) -> "FakeWorkers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        for t in self.threads:
            t.join(timeout=10)
        self.ctx.term()

    def _serve(self, endpoint: str, secret: bytes, run_id: str, rank: int) -> None:
        name = protocol.worker_name(rank)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, protocol.socket_identity(name))
        sock.setsockopt(zmq.LINGER, 1000)
        secure_client(sock, CurveKeys.of(secret))
        sock.connect(endpoint)
        channel = protocol.Channel(secret, run_id, name)
        send = lambda body: sock.send_multipart(channel.pack(protocol.MASTER, body))  # noqa: E731
        send(protocol.Hello(rank=rank, pid=os.getpid(), host=socket.gethostname()))
        later: list[tuple[float, int, protocol.Reply]] = []  # held replies: (when, order, reply)
        order = itertools.count()
        last_request = time.monotonic()
        try:
            while True:
                holding = bool(later)
                # at most 200 ms, so that leaving the with block ends a rank that holds a reply for long
                ready = sock.poll(min(200, max(0, int((later[0][0] - time.monotonic()) * 1000))) if holding else 200)
                if self.closing.is_set():
                    return
                while later and later[0][0] <= time.monotonic():
                    send(heapq.heappop(later)[2])
                if not ready:
                    if holding or time.monotonic() - last_request < 30:  # the poll only waited for a held reply
                        continue
                    return  # 30 s without a request: the master is gone
                last_request = time.monotonic()
                env = channel.try_unpack(sock.recv_multipart(), protocol.MASTER)
                if env is None:
                    continue
                req = env.body
                if rank == 0:
                    self.requests.append(req.type)
                outputs, samples, stats = [], [], {}
                if isinstance(req, protocol.RunCall):
                    meta = [protocol.TensorMeta(name="x", dtype="float32", shape=[1])]
                    keys = self.outputs[req.call]
                    if req.eval_batch >= 0:  # an evaluation pass: its own keys, and a score for the eval reward
                        keys = [eval_key(req.eval_batch, k) for k in keys]
                        stats = {"score_sum": 0.5, "n_seqs_scored": 1.0}
                    outputs = [protocol.OutputMeta(key=k, tensors=meta) for k in keys]
                    samples = self.samples(req.call, req.iteration, rank)
                stats = {**stats, **self.reply_stats(req, rank)}
                time.sleep(self.delays.get(req.type, 0.0))
                error = self.fails(req, rank)
                reply = protocol.Reply(req=req.req, rank=rank, ok=not error, outputs=outputs, samples=samples,
                                       stats=stats, error=error)
                if hold := self.held(req, rank):
                    heapq.heappush(later, (time.monotonic() + hold, next(order), reply))
                    continue
                send(reply)
                if isinstance(req, protocol.Shutdown):
                    return
        finally:
            sock.close()
