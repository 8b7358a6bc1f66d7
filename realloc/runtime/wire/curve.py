"""Transport security of the master's socket: CURVE encryption (ZMQ RFC 26) with keys derived from the run
secret, and a ZAP handler (RFC 27) that admits only the run's workers.

Why a handshake and not only size limits: ``ZMQ_MAXMSGSIZE`` bounds one frame, not the number of frames of
a message, and libzmq queues every frame of a multipart message until its last one arrives. Any peer that
may connect can therefore grow the receiver's memory without bound with many frames, each under the limit
(libzmq has no per-message limit). Under CURVE no frame of a peer is queued before its handshake
completes, and the handshake completes only for a client that proves it holds the run's client key:
another local process gets its connection closed after a few hundred bytes of handshake.

Keys: ``HMAC-SHA256(secret, label)`` is a Curve25519 secret key (any 32 bytes are one), one for the
master and one shared by the workers; the public keys follow from them. So the keys live wherever the
run's HMAC key lives (the run directory's 0600 ``secret`` file, or ``$REALLOC_SECRET``), and every
launcher that hands the workers the secret (local, SLURM, Ray) hands them the keys. The HMAC of
``protocol.py`` stays: it binds each message to its run, sender and sequence number.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from realloc.runtime.wire import protocol

ZAP_DOMAIN = "realloc"
_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

log = logging.getLogger("realloc.curve")


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs of the master (server) and the workers (client) of one run."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def of(cls, secret: bytes) -> "CurveKeys":
        if not zmq.has("curve"):
            raise ValueError("this pyzmq/libzmq build has no CURVE security (zmq.has('curve') is False), which the "
                             "master's socket requires; install the pyzmq wheel from PyPI, which bundles a libzmq "
                             "with CURVE")

        def pair(label: bytes) -> tuple[bytes, bytes]:
            key = z85.encode(hmac.new(secret, b"realloc curve " + label, hashlib.sha256).digest())
            return zmq.curve_public(key), key

        return cls(*pair(b"server"), *pair(b"client"))


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (not yet bound) a CURVE server that asks the ZAP handler (``Gatekeeper``) about every
    client, and apply the protocol's frame limit."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    protocol.limit_frame_size(sock)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of the run's master, and apply the frame limit."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    protocol.limit_frame_size(sock)


class _RunWorkersOnly:
    """The ZAP credentials check: the client's long-term public key is the run's worker key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and hmac.compare_digest(key, self.client_public)


class Gatekeeper:
    """The ZAP handler of a context (a thread, so handshakes go on while the master's event loop is busy),
    and a monitor of the server socket that logs every refused handshake.

    Create it before binding the socket: libzmq lets a CURVE handshake through unasked while no ZAP
    handler exists.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("realloc.curve.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, _RunWorkersOnly(keys.client_public))
        self.monitor: Any = None
        self.n_refused = 0
        self.refused: dict[str, int] = {}  # reason -> connections refused for it

    def watch(self, sock: zmq.Socket) -> Any:
        """Start monitoring ``sock``'s handshakes; returns the monitor socket (of ``sock``'s class) to read
        with ``on_event``."""
        self.monitor = sock.get_monitor_socket(_REFUSALS)
        return self.monitor

    def on_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        why = ("its key is not the run's worker key" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
               else "it did not complete a CURVE handshake with the run's keys")
        self.n_refused += 1
        n = self.refused[why] = self.refused.get(why, 0) + 1
        # The first few of each kind are the interesting ones; a peer that keeps reconnecting must not fill the log.
        if n <= 3 or n % 1000 == 0:
            log.warning("master: refused a connection to %s (%d so far): %s", event["endpoint"].decode(errors="replace"),
                        n, why)

    def close(self, sock: zmq.Socket) -> None:
        """Stop monitoring ``sock`` and stop the ZAP handler (before the context is terminated)."""
        if self.monitor is not None:
            sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        self.auth.stop()
