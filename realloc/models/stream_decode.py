"""Generation stopped at a split point and continued in place (streaming without migration, issue 31 item 2;
docs/tail-semantics.md).

``SplitGeneration`` decodes a dp replica's rows as ``tail_decode.decode_until`` does (its micro-batches advance
one step each per round, and after every step the whole call's running rows are summed over the dp replicas:
``until`` with a blocking ``global_count``, ``until_counted`` with counts that arrive late while the replica decodes
on) up to the split point, the first step after which at most a threshold of rows are running. Unlike a
migration, nothing moves: the micro-batches keep their KV caches and sampling state, hand out the finished rows,
and later ``finish`` the running ones with the very decode steps an uninterrupted run makes. Sampling is seeded per
row, so every token and log-prob is the plain generation's. At pp > 1 a step runs through the stages
(``stream_pipeline.py``), every micro-batch in flight from the first step (micro-batch streaming: every micro-batch of
one wave of pp).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from realloc.models.generation import GenerationOutput, _concat, _MicroBatch, _Wire
from realloc.models.sampling import GenerationConfig
from realloc.models.static_decode import DecodingModel
from realloc.models.stream_pipeline import pipelined_step
from realloc.models.tail_decode import StepCounts, select_rows
from realloc.strategy import even_ranges


class SplitGeneration:
    """One replica's rows (prompts ``rows``, sequence ids ``seq_ids``) in ``n_mbs`` micro-batches side by side (or
    one after another: ``one_by_one``)."""

    def __init__(self, model: DecodingModel, rows: list[torch.Tensor], gconfig: GenerationConfig,
                 seq_ids: Sequence[int], n_mbs: int, one_by_one: bool = False) -> None:
        if one_by_one and model.groups.pp != 1 and n_mbs % model.groups.pp:
            raise ValueError(f"streaming micro-batches ('micro_batches' tail entry) at pp {model.groups.pp}: they go "
                             f"in waves of pp, so n_mbs must be a multiple of {model.groups.pp} (got {n_mbs})")
        model.stage.eval()
        self.model = model
        self.n, self.pad = len(rows), gconfig.pad_token_id
        spans = [(lo, hi) for lo, hi in even_ranges(len(rows), max(1, min(n_mbs, len(rows)))) if hi > lo] if rows \
            else []
        self.mbs = [_MicroBatch(model, rows[lo:hi], list(seq_ids[lo:hi]), gconfig) for lo, hi in spans]
        self.offsets = [lo for lo, _ in spans]
        # one_by_one: the micro-batches decode one after another, as the plain call does at pp 1 (a plan's
        # ``TailMigration.micro_batches``): a step advances the first unfinished micro-batch only, whose rows then
        # end before the next one starts; a later micro-batch's rows count as running until they end. At pp > 1 the
        # unit is a wave of pp micro-batches stepped through the stages together (stream_pipeline.py), as the plain
        # pipelined call keeps pp in flight: a wave's rows are handed on when its last token leaves the last stage
        self.one_by_one = one_by_one
        self.wave = model.groups.pp if one_by_one else 1
        self.steps = [0] * len(self.mbs)  # one_by_one: each micro-batch's next step, as in the plain call
        self.t = 0  # the next step
        # pp > 1: the stages' decode step (stream_pipeline.py), its point-to-point traffic on the pp group
        self.wire = _Wire(model) if model.groups.pp > 1 else None
        self.left = -1  # the whole call's running rows after the last split point's step (-1: none yet)
        # counts that may arrive late (``until_counted``): each step's local running rows, and the last split
        # point's step (the decoding may have run past it); side by side at pp 1 only, where a row's generated
        # length tells the step it finished at
        self.local: list[int] = []
        self.split = -1
        self.late_counts = not one_by_one and self.wire is None

    def _step(self) -> None:
        if self.one_by_one:
            k = next((k for k, mb in enumerate(self.mbs) if not mb.done), None)
            if k is not None and self.wire is not None:  # pp > 1: the unfinished wave's step through the stages
                lo = k - k % self.wave
                pipelined_step(self.model, self.mbs[lo:lo + self.wave], self.wire, self.steps[lo])
                self.steps[lo] += 1
            elif k is not None:
                mb, t = self.mbs[k], self.steps[k]
                mb.apply(mb.sample(mb.forward(None, t), t), t)
                self.steps[k] += 1
            return
        if self.wire is not None:
            pipelined_step(self.model, self.mbs, self.wire, self.t)
        for mb in self.mbs if self.wire is None else ():
            if not mb.done:
                mb.apply(mb.sample(mb.forward(None, self.t), self.t), self.t)
        self.t += 1
        if self.late_counts:
            self.local.append(sum(mb.n_active for mb in self.mbs if not mb.done))

    def running(self) -> list[int]:
        """Local positions of the rows still decoding after the last split point, ascending (rows that ended in
        steps decoded past it count as running: they belong to the next part)."""
        now = sorted(off + int(i) for mb, off in zip(self.mbs, self.offsets) if not mb.done
                     for i in mb.active.tolist())
        if not self.late_counts or self.split < 0 or self.split == self.t - 1:
            return now
        # a row that ended at step f has generated f + 1 tokens
        late = {off + b for mb, off in zip(self.mbs, self.offsets) for b, n in enumerate(mb.gen_len.tolist())
                if n > self.split + 1}
        return sorted(set(now) | late)

    @torch.no_grad()
    def until(self, global_count: Callable[[int], int], threshold: int) -> bool:
        """Decode to the split point; False if the whole call ended first (no step left 1..threshold rows).
        ``global_count(local)`` is called once per step on every replica, the same number of times. A later split
        point (chunked streaming) that an earlier step already passed takes no step."""
        while self.left < 0 or self.left > threshold:
            self._step()
            self.left = global_count(sum(mb.n_active for mb in self.mbs if not mb.done))
            self.split = self.t - 1
        return self.left > 0

    @torch.no_grad()
    def until_counted(self, counts: StepCounts, threshold: int) -> bool:
        """``until`` with the whole call's counts learned asynchronously (``counts``, e.g. the windowed
        all-reduces of ``worker_tail.AsyncCounts``; side by side at pp 1 only): the replica posts its count after
        every step and decodes on without waiting, and waits only when it has nothing left to decode. The split
        point is still the first step whose count is at most ``threshold`` (a lockstep run's), and ``running``
        names the rows unfinished after it. Every replica posts from the step after the previous split point
        (counts of steps it decoded ahead from its history), so the reductions pair up on every replica."""
        assert self.late_counts
        if 0 <= self.left <= threshold:  # an earlier step already passed this split point: no step
            return self.left > 0
        start = self.split + 1
        known, posted, found = start, start, None
        while found is None:
            if posted == self.t and any(not mb.done for mb in self.mbs):
                self._step()
            counts.post(self.local[posted] if posted < self.t else 0)
            posted += 1
            busy = posted < self.t or any(not mb.done for mb in self.mbs)
            for total in counts.ready(block=not busy):  # nothing left to decode or post: wait for the others
                if total <= threshold:
                    found = (known, total)
                    break
                known += 1
        counts.close()
        self.split, self.left = found
        return self.left > 0

    @torch.no_grad()
    def finish(self) -> None:
        """Decode the running rows to their end with the same steps an uninterrupted run makes."""
        while any(not mb.done for mb in self.mbs):
            self._step()

    def output(self, positions: Sequence[int]) -> GenerationOutput:
        """The generation results (so far) of the rows at local ``positions``, in that order."""
        outs = [mb.output() for mb in self.mbs]
        full = outs[0] if len(outs) == 1 else _concat(outs, self.pad)
        return select_rows(full, positions)
