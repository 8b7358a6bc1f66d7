"""A model worker's heartbeat thread (``worker.py``): it reports liveness and the request in progress every second on
its own socket, and ends the process if the master stops answering (the master died) or aborts the run, so no
worker outlives a run."""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from realloc.runtime.wire import protocol
from realloc.runtime.wire.curve import CurveKeys, secure_client

HEARTBEAT_INTERVAL = 1.0
MASTER_TIMEOUT = 30.0  # no answer from the master for this long: it is gone, so stop

log = logging.getLogger("realloc.worker")


class Heartbeat(threading.Thread):
    def __init__(self, ctx: zmq.Context, endpoint: str, secret: bytes, run_id: str, rank: int) -> None:
        super().__init__(name="heartbeat", daemon=True)
        name = protocol.heartbeat_name(rank)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, protocol.socket_identity(name))
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, CurveKeys.of(secret))
        self.sock.connect(endpoint)
        self.channel = protocol.Channel(secret, run_id, name)
        self.rank = rank
        self.busy_req = -1
        self.stop_signal = 0  # reported with every heartbeat once the worker got SIGTERM
        self._stopping = threading.Event()

    def run(self) -> None:
        last_answer = time.monotonic()
        while not self._stopping.is_set():
            self.sock.send_multipart(self.channel.pack(protocol.MASTER, protocol.Heartbeat(
                rank=self.rank, busy_req=self.busy_req, stop_signal=self.stop_signal)))
            deadline = time.monotonic() + HEARTBEAT_INTERVAL
            while (left := deadline - time.monotonic()) > 0 and not self._stopping.is_set():
                if self.sock.poll(int(left * 1000)):
                    env = self.channel.try_unpack(self.sock.recv_multipart(), protocol.MASTER)
                    if env is not None:
                        last_answer = time.monotonic()
                        if isinstance(env.body, protocol.Abort):
                            log.error("worker %d: the master aborted the run: %s", self.rank, env.body.reason)
                            os._exit(4)
            if time.monotonic() - last_answer > MASTER_TIMEOUT:
                log.error("worker %d: no answer from the master for %.0f s; exiting", self.rank, MASTER_TIMEOUT)
                os._exit(3)
        self.sock.close(linger=0)

    def stop(self) -> None:
        self._stopping.set()
