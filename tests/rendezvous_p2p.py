"""Point-to-point messages with NCCL's semantics, on gloo: for testing the fused pipeline's protocol on CPU.

gloo buffers a send and matches messages by tag, so a program whose sends wait for receives the peer has not
posted yet still completes on gloo. NCCL does not: between two ranks, its sends and receives run on one stream,
each completing only together with its peer's matching operation (rendezvous), one after the other in the
order posted, and it pairs them by that order, not by tag. ``RendezvousP2P`` gives ``isend``/``irecv`` these
semantics over gloo, so a program that deadlocks on NCCL deadlocks here too:

- every link to a peer rank has one thread that runs the operations posted on it, in the order posted, each
  to completion before the next starts (NCCL's stream per pair of ranks);
- a send completes only when the peer's thread has received it and acknowledged it (a rendezvous: the peer
  reaches that receive only after its own earlier operations on the link);
- every message travels under one tag per link and direction, with a header naming the tag and the number the
  caller gave it; a receive that gets another message than the one it was posted for raises (NCCL would have
  paired them silently).

A wait that lasts ``timeout`` seconds raises ``RendezvousDeadlock``. Install it in place of
``torch.distributed`` where the code under test calls ``dist.isend``/``dist.irecv``
(``with RendezvousP2P(...).installed(module): ...``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import types
from typing import Any, Iterator

import torch
import torch.distributed as dist

DATA_TAG = 7_000_001  # headers and tensors, in order; far above the tags the code under test uses
ACK_TAG = 7_000_002


class RendezvousDeadlock(RuntimeError):
    pass


class _Op:
    def __init__(self, kind: str, tensor: torch.Tensor, tag: int, seq: int, timeout: float) -> None:
        self.kind, self.tensor, self.tag, self.seq, self.timeout = kind, tensor, tag, seq, timeout
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        if not self.done.wait(self.timeout):
            raise RendezvousDeadlock(f"{self.kind} of tag {self.tag} (#{self.seq}) waited {self.timeout:g} s: under "
                                     f"rendezvous semantics this program deadlocks")
        if self.error is not None:
            raise self.error
        return True


class _Link:
    """The operations posted towards one peer rank, run in the order posted by one thread."""

    def __init__(self, peer: int, group: Any) -> None:
        self.peer, self.group = peer, group
        self.ops: "queue.Queue[_Op | None]" = queue.Queue()
        self.broken: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"rendezvous-{peer}")
        self.thread.start()

    def _run(self) -> None:
        while True:
            op = self.ops.get()
            if op is None:
                return
            try:
                if self.broken is not None:
                    raise self.broken
                self._send(op) if op.kind == "send" else self._recv(op)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                self.broken = self.broken or e
                op.error = e
            op.done.set()

    def _send(self, op: _Op) -> None:
        dist.send(torch.tensor([op.tag, op.seq], dtype=torch.int64), self.peer, group=self.group, tag=DATA_TAG)
        dist.send(op.tensor, self.peer, group=self.group, tag=DATA_TAG)
        dist.recv(torch.zeros(1, dtype=torch.int64), self.peer, group=self.group, tag=ACK_TAG)  # the rendezvous

    def _recv(self, op: _Op) -> None:
        head = torch.zeros(2, dtype=torch.int64)
        dist.recv(head, self.peer, group=self.group, tag=DATA_TAG)
        if head.tolist() != [op.tag, op.seq]:
            raise RuntimeError(f"a receive posted for tag {op.tag} (#{op.seq}) got the message of tag "
                               f"{int(head[0])} (#{int(head[1])}): the two ranks post this link's operations in "
                               f"different orders, which NCCL pairs wrongly")
        dist.recv(op.tensor, self.peer, group=self.group, tag=DATA_TAG)
        dist.send(torch.ones(1, dtype=torch.int64), self.peer, group=self.group, tag=ACK_TAG)

    def close(self) -> None:
        self.ops.put(None)


class RendezvousP2P:
    """``isend``/``irecv`` of ``torch.distributed`` with NCCL's semantics (module docstring). The messages
    carrying one (peer, tag) are numbered in the order posted; both ranks number alike when they post alike."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.links: dict[int, _Link] = {}
        self.counts: dict[tuple[str, int, int], int] = {}
        self.ops = 0

    def _post(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> _Op:
        # One link per peer rank, whatever the group (both models' pipelines): stricter than NCCL, which runs a
        # stream per communicator, so a program that completes here completes there.
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = _Link(peer, group)
        key = (kind, peer, tag)
        seq = self.counts.get(key, 0)
        self.counts[key] = seq + 1
        op = _Op(kind, tensor, tag, seq, self.timeout)
        self.ops += 1
        link.ops.put(op)
        return op

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> _Op:
        return self._post("send", tensor, dst, group, tag)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> _Op:
        return self._post("recv", tensor, src, group, tag)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        for link in self.links.values():
            link.thread.join(timeout=1.0)  # a thread left blocked by a deadlock is a daemon: leave it

    @contextlib.contextmanager
    def installed(self, module: Any) -> Iterator["RendezvousP2P"]:
        """``module.dist`` (its ``torch.distributed``) replaced by one whose isend/irecv are these."""
        real = module.dist
        module.dist = types.SimpleNamespace(isend=self.isend, irecv=self.irecv)
        try:
            yield self
        finally:
            module.dist = real
            self.close()
