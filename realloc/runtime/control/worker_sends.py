"""A worker's point-to-point sends of data transfers, left running (issue 31: chunked streaming; docs/tail-semantics.md).

A blocking send waits until the receiver posts its receive. When a streaming generation hands a chunk of rows to a
consumer that is still busy with the last chunk, its device would wait in that send instead of decoding on: the
two devices would take turns instead of overlapping. So the sender posts the send and goes on; the buffer stays
referenced here until the send completes. Every pair of ranks posts its messages in the master's dispatch order (each
worker takes its requests in that order), and messages between two ranks are matched in order, so the receiver gets
the same bytes as with a blocking send. ``drain`` waits for every send left (before data is released, a checkpoint
is saved or the worker shuts down).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class PendingSends:
    def __init__(self) -> None:
        self.works: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, buf: torch.Tensor, dst: int) -> None:
        self.works = [(w, b) for w, b in self.works if not w.is_completed()]
        work = dist.isend(buf, dst)
        assert work is not None
        self.works.append((work, buf))

    def drain(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works = []
