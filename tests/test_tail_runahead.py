"""Phase 1 of a tail migration without a wait at every step (docs/streaming.md, "Where the time goes"): the counts
of unfinished rows may arrive late, a replica decodes past the migration point meanwhile and takes its rows back to
it; the migration point, the finished rows and the tail's tokens are those of the lockstep run."""

from __future__ import annotations

import time

import pytest
import torch

from model_helpers import build_model
from realloc.models.config import get_model_config
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_length_schedule import _prompts as _prompt_lists


class _LateCounts:
    """One replica's counts, each known only ``lag`` posts later (all of them once the replica waits)."""

    def __init__(self, lag: int) -> None:
        self.lag, self.posted, self.given, self.closed = lag, [], 0, False

    def post(self, local: int) -> None:
        self.posted.append(local)

    def ready(self, block: bool) -> list[int]:
        upto = len(self.posted) if block else max(self.given, len(self.posted) - self.lag)
        out, self.given = self.posted[self.given:upto], upto
        return out

    def close(self) -> None:
        self.closed = True


def _phase_one(ctx, gconfig, threshold, lag):
    from realloc.models.tail_decode import decode_until

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=3)
    if model is None:
        return None
    rows = [torch.tensor(p) for p in _prompt_lists()]
    lockstep = decode_until(model, rows, gconfig, range(N_ROWS), 2, lambda n: n, threshold)
    late = _LateCounts(lag)
    ahead = decode_until(model, rows, gconfig, range(N_ROWS), 2, late, threshold)
    return lockstep, ahead, len(late.posted), late.closed


def _same(a, b) -> None:
    assert a.step == b.step and a.finished == b.finished and a.tail.seq_ids == b.tail.seq_ids
    assert torch.equal(a.tail.tokens, b.tail.tokens) and torch.equal(a.tail.logprobs, b.tail.logprobs)
    assert torch.equal(a.output.sequences, b.output.sequences) and torch.equal(a.output.lengths, b.output.lengths)
    assert torch.equal(a.output.logprobs, b.output.logprobs)


@pytest.mark.parametrize("threshold,lag", [(3, 4), (1, 50), (0, 3)])
def test_late_counts_give_the_lockstep_migration_point_rows_and_tokens(pool, threshold, lag):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                               length_schedule=SCHEDULE)
    lockstep, ahead, posted, closed = next(r for r in pool.run(_phase_one, gconfig, threshold, lag) if r)
    _same(lockstep, ahead)
    assert closed
    if threshold:  # a migration point, passed by up to ``lag`` steps before its count arrived
        assert lockstep.step >= 0 and lockstep.tail.seq_ids and lockstep.tail.steps == lockstep.step + 1
        assert lockstep.step + 1 < posted <= lockstep.step + 1 + lag
    else:  # at most 0 rows left: every row ended, no migration point
        assert lockstep.step == -1 and not lockstep.tail.seq_ids and len(lockstep.finished) == N_ROWS


def _two_replicas(ctx, gconfig, threshold, delay):
    """Both replicas of dp 2 run phase 1 with asynchronous counts, replica 1 starting ``delay`` s late, then the
    rows' all-gather on the same group; and the same with a blocking all-reduce per step."""
    import torch.distributed as dist

    from realloc.models.tail_decode import decode_until
    from realloc.runtime.control.worker_tail import AsyncCounts, _gather

    model = build_model(ctx, get_model_config("tiny"), 2, 1, 1, seed=3)
    k, group = model.groups.dp_rank, model.groups.dp_group
    lo, hi = k * N_ROWS // 2, (k + 1) * N_ROWS // 2
    rows = [torch.tensor(p) for p in _prompt_lists()[lo:hi]]

    def blocking(local: int) -> int:
        t = torch.tensor([local], dtype=torch.long)
        dist.all_reduce(t, group=group)
        return int(t.item())

    lockstep = decode_until(model, rows, gconfig, range(lo, hi), 1, blocking, threshold)
    if k == 1:
        time.sleep(delay)
    counts = AsyncCounts(group, 2)
    ahead = decode_until(model, rows, gconfig, range(lo, hi), 1, counts, threshold)
    ids = torch.tensor(ahead.tail.seq_ids, dtype=torch.long)
    gathered = _gather({"id": ids}, group, 2, torch.device("cpu"))["id"].tolist()
    return lockstep, ahead, counts.posted, gathered


def test_asynchronous_counts_over_gloo_agree_on_the_point_and_leave_the_group_in_step(pool):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                               length_schedule=SCHEDULE)
    got = pool.run(_two_replicas, gconfig, 3, 0.5)
    for lockstep, ahead, _, _ in got:
        _same(lockstep, ahead)
    steps = {lockstep.step for lockstep, _, _, _ in got}
    assert len(steps) == 1 and steps.pop() >= 0
    tail = sorted(i for lockstep, _, _, _ in got for i in lockstep.tail.seq_ids)
    assert 1 <= len(tail) <= 3
    assert got[0][3] == got[1][3] and sorted(got[0][3]) == tail  # the all-gather after close pairs up
    assert got[0][2] == got[1][2]  # both issued the same collectives


def _kept_and_redone(ctx, gconfig, threshold):
    """A replica that ran to its end before the counts came: phase 2 on its tail keeps the first half of the rows
    it finished ahead and decodes the rest again after a re-run prefill."""
    from realloc.models.tail_decode import decode_until
    from realloc.runtime.control.worker_tail import _phase_two, _row_table

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=3)
    if model is None:
        return None
    rows = [torch.tensor(p) for p in _prompt_lists()]
    plain = model.generate([r.tolist() for r in rows], gconfig, seq_ids=range(N_ROWS), n_mbs=2)
    one = decode_until(model, rows, gconfig, range(N_ROWS), 2, _LateCounts(10 * MAX_NEW), threshold)
    t = one.tail
    mine = _row_table({}, range(len(t.seq_ids)), t.prompts, t.seq_ids, t.tokens, t.logprobs,
                      [t.steps] * len(t.seq_ids), [False] * len(t.seq_ids), max(p.numel() for p in rows), MAX_NEW)
    half = list(one.ahead[:max(1, len(one.ahead) // 2)])  # seq ids: the rows are 0..N_ROWS-1
    return plain, one, _phase_two(model, one, half, mine, gconfig, 1), half


def test_a_tail_replica_keeps_the_rows_it_finished_ahead_and_redoes_the_others(pool):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                               length_schedule=SCHEDULE)
    plain, one, out, kept = next(r for r in pool.run(_kept_and_redone, gconfig, 3) if r)
    assert one.step >= 0 and len(one.ahead) == len(one.tail.seq_ids) >= 2  # every tail row finished ahead
    assert 1 <= len(kept) < len(one.tail.seq_ids)
    for r, i in enumerate(one.tail.seq_ids):  # in the tail's order; the kept rows bit for bit
        a, b = slice(int(plain.prompt_lengths[i]), int(plain.lengths[i])), slice(int(out.prompt_lengths[r]),
                                                                                int(out.lengths[r]))
        assert out.sequences[r, b].tolist() == plain.sequences[i, a].tolist()
        assert bool(out.stopped_at_eos[r]) == bool(plain.stopped_at_eos[i])
        if i in kept:
            assert torch.equal(out.logprobs[r, b], plain.logprobs[i, a])
        else:
            assert torch.allclose(out.logprobs[r, b], plain.logprobs[i, a], atol=1e-5)
