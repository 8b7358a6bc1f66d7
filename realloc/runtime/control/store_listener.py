"""The rendezvous of the workers' process group: a listening socket the master binds, and the TCPStore on it.

torch's ``TCPStore`` listens on every interface unless handed a socket, so the master binds one where ``--bind``
says (loopback locally). Under SLURM and Ray the master serves the store on it itself. A local run hands the
socket to worker 0 instead (``LocalLauncher``: the worker inherits the descriptor, ``--store-fd``), so that the
master never imports torch: torch.distributed is 1.6 CPU s of a start-up that runs three processes on the
machine's cores (docs/speed.md). The workers connect to the same host and port either way.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any


class StoreListener:
    """A TCP socket bound and listening for the rendezvous store, before any store exists."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise port_in_use("--store-port", host, port, e.strerror or str(e)) from None
        self.sock.listen(1024)
        self.host = host
        self.port: int = self.sock.getsockname()[1]

    def fileno(self) -> int:
        return self.sock.fileno()

    def detach(self) -> int:
        """The descriptor, now owned by whoever takes it (a TCPStore closes it when it goes)."""
        return self.sock.detach()

    def close(self) -> None:
        """This process's copy (a worker that inherited the descriptor keeps its own)."""
        self.sock.close()


def port_in_use(option: str, host: str, port: int, why: str) -> ValueError:
    """The one line for a rendezvous or master port this run cannot bind (under SLURM both derive from the job
    id, so two jobs on one node can meet on them)."""
    return ValueError(f"{option} {port}: cannot listen on {host}:{port} ({why}); another process (another run's "
                      f"master?) holds it: pass another {option}, or 0 for a free one")


def store_listener(host: str, port: int = 0) -> StoreListener:
    return StoreListener(host, port)


def rendezvous_store(host: str, port: int, listen_fd: int | None, timeout: datetime.timedelta) -> Any:
    """A worker's TCPStore client of ``host:port``; with ``listen_fd`` (worker 0 of a local run) the store's
    server, on the socket the master bound and handed down."""
    import torch.distributed as dist

    if listen_fd is None:
        return dist.TCPStore(host, port, None, False, timeout=timeout)
    return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd)
