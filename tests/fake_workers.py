"""Threads that play a run's model workers over the real wire protocol (CURVE + signed messages), so a
``Master`` can be driven through many iterations in a second, without torch work.

Each rank answers every request at once with success. A call's reply carries a one-float tensor per output
key of the call (what the master needs to plan the transfers), plus any sample-log parts ``samples(call,
iteration, rank)`` returns. ``delays`` (request type -> seconds) makes some requests slow, e.g. saves.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable

import zmq

from realloc.runtime import protocol
from realloc.runtime.curve import CurveKeys, secure_client

SampleParts = Callable[[str, int, int], list[protocol.SamplePart]]


class FakeWorkers:
    def __init__(self, endpoint: str, secret: bytes, run_id: str, n_workers: int, outputs: dict[str, list[str]],
                 samples: SampleParts = lambda call, t, rank: [], delays: dict[str, float] | None = None) -> None:
        self.ctx = zmq.Context()
        self.delays = delays or {}
        self.outputs = outputs
        self.samples = samples
        self.requests: list[str] = []  # kinds received by rank 0, in order
        self.threads = [threading.Thread(target=self._serve, args=(endpoint, secret, run_id, r), daemon=True)
                        for r in range(n_workers)]

    def __enter__(self) -> "FakeWorkers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
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
        try:
            while sock.poll(30_000):
                env = channel.try_unpack(sock.recv_multipart(), protocol.MASTER)
                if env is None:
                    continue
                req = env.body
                if rank == 0:
                    self.requests.append(req.type)
                outputs, samples = [], []
                if isinstance(req, protocol.RunCall):
                    meta = [protocol.TensorMeta(name="x", dtype="float32", shape=[1])]
                    outputs = [protocol.OutputMeta(key=k, tensors=meta) for k in self.outputs[req.call]]
                    samples = self.samples(req.call, req.iteration, rank)
                time.sleep(self.delays.get(req.type, 0.0))
                send(protocol.Reply(req=req.req, rank=rank, ok=True, outputs=outputs, samples=samples))
                if isinstance(req, protocol.Shutdown):
                    return
        finally:
            sock.close()
