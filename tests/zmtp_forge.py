"""A forger that speaks ZMTP 3.0 (ZMQ RFC 23) over a raw TCP socket, as a local attacker without the run's
secret would: it offers the NULL mechanism and then streams one message of many frames, without waiting
for the peer. Against a plain ZMQ socket the message arrives (every frame under ZMQ_MAXMSGSIZE, the
whole far above it); against the master's CURVE socket the connection is closed at the greeting.
"""

from __future__ import annotations

import socket
from typing import Iterator


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value


def greeting_and_ready(identity: bytes = b"") -> bytes:
    # signature (0xFF, 8 bytes padding, 0x7F), version 3.0, mechanism, as-server, filler: 64 bytes
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    body = b"\x05READY" + _property(b"Socket-Type", b"DEALER") + (_property(b"Identity", identity) if identity else b"")
    return greeting + b"\x04" + bytes([len(body)]) + body  # a short command frame


def message_frames(frames: list[bytes]) -> Iterator[bytes]:
    """Each frame as a long frame (flags 0x02), all but the last with MORE (0x01)."""
    for i, f in enumerate(frames):
        yield bytes([0x02 | (0x01 if i < len(frames) - 1 else 0)]) + len(f).to_bytes(8, "big")
        yield f


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := s.recv(n - len(data))):
        data += chunk
    return data


def forge(port: int, frames: list[bytes], identity: bytes = b"", hold: float = 1.0) -> bool:
    """Send a forged NULL handshake and one message of ``frames`` to 127.0.0.1:``port``, then keep the
    connection open up to ``hold`` seconds (libzmq drops what a peer sent if it hangs up at once).
    Returns False if the peer closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as s:
        try:
            s.sendall(greeting_and_ready(identity))
            # The frames may follow only the peer's READY (data during the handshake is a protocol error).
            greeting = _read(s, 64)
            if greeting[12:16] == b"NULL":
                flags_size = _read(s, 2)
                _read(s, flags_size[1] if len(flags_size) == 2 else 0)
            for chunk in message_frames(frames):  # sent in any case, as an attacker would
                s.sendall(chunk)
            s.settimeout(hold)
            while s.recv(65536):  # b"" once the peer closes
                pass
        except socket.timeout:
            return True
        except (BrokenPipeError, ConnectionResetError):
            pass
    return False
