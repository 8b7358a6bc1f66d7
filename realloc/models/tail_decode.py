"""Generation in two phases around a long-tail migration point (rlhfuse.txt §4; docs/streaming.md).

Phase 1 (``decode_until``) decodes a dp replica's rows like ``generation.generate`` does, but every micro-batch
advances one step per round (they run side by side instead of one after another), so a "step" means the same on
every replica: after each step the replica posts its unfinished rows to a ``StepCounts``, which learns the whole
call's count per step (the caller sums over the dp replicas), and the migration point is the first step where that
count is at most the threshold. The counts may arrive late (``worker_tail``'s counts are asynchronous
all-reduces): a replica keeps decoding while they are in flight, and once it learns the migration point it takes
the rows unfinished after that step back to that step (their tokens beyond it are decoded again in phase 2). So the
migration point and every token are those of a lockstep run, while no replica waits for another at every step.
Every row of the tail has generated exactly ``step + 1`` tokens.

Phase 2 (``continue_decoding``; for a plan whose tail moves the KV caches instead, ``kv_move.decode_moved``, from
the caches ``PhaseOne.held`` points at) takes such rows -- from this replica or another -- and decodes them to their
end: it rebuilds the KV cache by re-running prefill over prompt + tokens so far, starts each row's sampling generator
after the draws phase 1 made (one per generated token), and counts steps from ``step + 1``, so the length schedule,
the EOS ban and the ``max_new_tokens`` cut fall where they would have. The tokens are those of an unmigrated run up
to the floating-point difference between a prefill and the decode steps it replaces (the log-probs within float
tolerance; a token flips only if its uniform lands within that difference of a CDF boundary).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import torch

from realloc.models.generation import GenerationOutput, _concat, _MicroBatch
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig, draw_uniforms, sequence_generators
from realloc.models.static_decode import DecodingModel
from realloc.strategy import even_ranges


@dataclasses.dataclass
class TailRows:
    """Rows still decoding at the migration point: their prompts, and the tokens and log-probs generated so far
    (``steps`` each)."""

    seq_ids: list[int]
    prompts: list[torch.Tensor]  # 1-D long, each row's prompt
    tokens: torch.Tensor  # [rows, steps] long
    logprobs: torch.Tensor  # [rows, steps] float32

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[1])


@dataclasses.dataclass
class PhaseOne:
    """What phase 1 leaves on a replica: the finished rows' results (local positions ``finished``), the rows still
    decoding, and the step it stopped after (-1 if it ran to the end)."""

    finished: list[int]
    output: GenerationOutput  # of the finished rows, in local order
    tail: TailRows
    step: int
    # tail rows this replica finished while it ran ahead of the counts (local positions) and their whole results:
    # the same tokens phase 2 would decode again, so a tail replica that holds them keeps them (worker_tail.py)
    ahead: list[int] = dataclasses.field(default_factory=list)
    ahead_output: GenerationOutput | None = None
    # tail rows still in one of phase 1's caches (local position -> that micro-batch's caches, the row's place in
    # them, the micro-batch's left-padded prompt width): what a migration that moves KV caches cuts out (kv_move.py)
    held: dict[int, tuple[list, int, int]] = dataclasses.field(default_factory=dict)


def _check(model: DecodingModel, gconfig: GenerationConfig) -> None:
    if model.groups.pp != 1:
        raise ValueError("tail migration: the generation call must run at pp 1 (its decode steps are counted in "
                         "lockstep over the dp replicas); give the call pp=1 or drop its 'tail' plan entry")
    if gconfig.greedy:
        raise ValueError("tail migration needs sampled generation, not greedy decoding")


class StepCounts(Protocol):
    """The whole call's unfinished rows after each step, summed over the dp replicas."""

    def post(self, local: int) -> None:
        """This replica's unfinished rows after its next step (steps 0, 1, ... in order)."""

    def ready(self, block: bool) -> list[int]:
        """The whole call's counts learned since the last call, in step order; ``block``: wait for one at least."""

    def close(self) -> None:
        """Called once the migration point is known, before any other collective of the group."""


class SyncCounts:
    """``StepCounts`` from a function that returns the whole call's count at once (one replica, or a blocking
    all-reduce)."""

    def __init__(self, global_count: Callable[[int], int]) -> None:
        self._fn, self._got = global_count, []

    def post(self, local: int) -> None:
        self._got.append(self._fn(local))

    def ready(self, block: bool) -> list[int]:
        out, self._got = self._got, []
        return out

    def close(self) -> None:
        pass


@torch.no_grad()
def decode_until(model: DecodingModel, rows: list[torch.Tensor], gconfig: GenerationConfig, seq_ids: Sequence[int],
                 n_mbs: int, counts: "StepCounts | Callable[[int], int]", threshold: int) -> PhaseOne:
    """Phase 1 for this replica's ``rows`` (prompts). ``counts`` learns the whole call's unfinished rows per step
    (a plain function: ``global_count(local)`` at every step, blocking); every replica posts one count per step up
    to the migration point at least."""
    _check(model, gconfig)
    counter: StepCounts = counts if hasattr(counts, "post") else SyncCounts(counts)  # type: ignore[arg-type]
    model.stage.eval()
    n_mbs = max(1, min(n_mbs, len(rows)))
    spans = even_ranges(len(rows), n_mbs) if rows else []
    mbs = [_MicroBatch(model, rows[lo:hi], list(seq_ids[lo:hi]), gconfig) for lo, hi in spans if hi > lo]
    t, known, found = 0, 0, None  # the next step to decode, the steps whose count is known, the first at most R_t
    while found is None:
        busy = [mb for mb in mbs if not mb.done]
        for mb in busy:
            mb.apply(mb.sample(mb.forward(None, t), t), t)
        counter.post(sum(mb.n_active for mb in mbs if not mb.done))
        t += 1
        for left in counter.ready(block=not busy):  # nothing left to decode here: wait for the others' counts
            if left <= threshold:
                found = (known, left)
                break
            known += 1
    counter.close()
    stop = found[0] if found[1] > 0 else -1  # all rows ended together: no migration point
    steps = stop + 1 if stop >= 0 else 0
    offsets = [lo for lo, hi in spans if hi > lo]
    outs = [mb.output() for mb in mbs]
    full = (outs[0] if len(outs) == 1 else _concat(outs, gconfig.pad_token_id)) if outs else None
    if full is None:
        empty = torch.zeros((0, 1), dtype=torch.long)
        output = GenerationOutput(empty, empty[:, 0], empty[:, 0], empty.float(), empty[:, 0].bool())
        return PhaseOne([], output, TailRows([], [], empty[:, :0], empty[:, :0].float()), stop)
    # unfinished after the migration point: still decoding here, or finished by a step this replica ran ahead to
    gen = full.gen_lengths.tolist()
    active = {off + int(i) for mb, off in zip(mbs, offsets) if not mb.done for i in mb.active.tolist()}
    running = [i for i in range(len(rows)) if stop >= 0 and (i in active or gen[i] > steps)]
    still = set(running)
    finished = [i for i in range(len(rows)) if i not in still]
    tok = torch.stack([full.sequences[i, len(rows[i]):len(rows[i]) + steps] for i in running]) if running else \
        torch.zeros((0, steps), dtype=torch.long)
    lp = torch.stack([full.logprobs[i, len(rows[i]):len(rows[i]) + steps] for i in running]) if running else \
        torch.zeros((0, steps), dtype=torch.float32)
    tail = TailRows([int(seq_ids[i]) for i in running], [rows[i] for i in running], tok.cpu(), lp.cpu())
    ahead = [i for i in running if i not in active]
    held = {off + int(i): (mb.caches, j, mb.P) for mb, off in zip(mbs, offsets) if not mb.done
            for j, i in enumerate(mb.active.tolist()) if off + int(i) in still}
    return PhaseOne(finished, select_rows(full, finished), tail, stop, ahead,
                    select_rows(full, ahead) if ahead else None, held)


def select_rows(out: GenerationOutput, rows: Sequence[int]) -> GenerationOutput:
    """The rows ``rows`` of ``out``, in that order, trimmed to their longest sequence."""
    idx = torch.tensor(list(rows), dtype=torch.long, device=out.sequences.device)
    sel = {f.name: getattr(out, f.name)[idx] for f in dataclasses.fields(out)}
    width = int(sel["lengths"].max()) if len(rows) else 1
    sel["sequences"], sel["logprobs"] = sel["sequences"][:, :width], sel["logprobs"][:, :width]
    return GenerationOutput(**sel)


def _advance(gen: torch.Generator, n: int) -> torch.Generator:
    """The generator after ``n`` single draws (a vector draw of n equals n single ones: test_static_decode.py)."""
    if n:
        torch.rand(n, generator=gen, dtype=torch.float64)
    return gen


@torch.no_grad()
def continue_decoding(model: DecodingModel, tail: TailRows, gconfig: GenerationConfig, n_mbs: int = 1
                      ) -> GenerationOutput:
    """Phase 2: decode ``tail``'s rows to their end after re-running their prefill; the result covers the whole
    response (phase 1's tokens and log-probs, then phase 2's), in ``tail``'s row order."""
    _check(model, gconfig)
    g, n = tail.steps, len(tail.seq_ids)
    assert n and 0 < g < gconfig.max_new_tokens, (n, g)
    model.stage.eval()
    rest = dataclasses.replace(gconfig, max_new_tokens=gconfig.max_new_tokens - g,
                               min_new_tokens=max(0, gconfig.min_new_tokens - g))
    full_rows = [torch.cat([p.cpu(), tail.tokens[i]]) for i, p in enumerate(tail.prompts)]
    outs = []
    for lo, hi in even_ranges(n, max(1, min(n_mbs, n))):
        mb = _MicroBatch(model, full_rows[lo:hi], tail.seq_ids[lo:hi], rest)
        if mb.uniforms is not None:  # each row's draws after the g that phase 1 made (one per generated token)
            gens = [_advance(gen, g) for gen in sequence_generators(gconfig.seed, tail.seq_ids[lo:hi])]
            mb.uniforms = draw_uniforms(gens, mb.N).to(mb.uniforms.device)
        if gconfig.length_schedule is not None:  # the schedule counts the whole response: phase 2 starts at g
            whole = scheduled_lengths(gconfig.length_schedule, gconfig.max_new_tokens, gconfig.seed,
                                      tail.seq_ids[lo:hi])
            assert mb.target is not None
            mb.target = mb.target.new_tensor([x - g for x in whole])
        t = 0
        while not mb.done:
            mb.apply(mb.sample(mb.forward(None, t), t), t)
            t += 1
        outs.append(mb.output())
    cont = outs[0] if len(outs) == 1 else _concat(outs, gconfig.pad_token_id)
    # phase 1's tokens were the prompt of phase 2: give them back their log-probs and the response
    plen = torch.tensor([p.numel() for p in tail.prompts], dtype=torch.long, device=cont.lengths.device)
    lps = cont.logprobs.clone()
    for i in range(n):
        p = int(plen[i])
        lps[i, p:p + g] = tail.logprobs[i].to(lps.device)
    return GenerationOutput(cont.sequences, cont.lengths, plen, lps, cont.stopped_at_eos)

