"""Phase 1's counts of unfinished rows sent a few steps per all-reduce (``worker_tail.AsyncCounts``'s window;
docs/streaming.md, "A longer batch"): both replicas learn the lockstep migration point (brute force: the first step
whose summed count is at most R_t), a replica with nothing left to decode sends its open window early, both issue
the same collectives, and the group is in step for the all-gather after ``close``."""

from __future__ import annotations

import pytest
import torch

from test_length_schedule import pool  # noqa: F401 - the module's gloo pool
from test_tail_runahead import _same, _two_replicas

# per-step unfinished rows of each replica: replica 1 runs out of rows at step 5 (then posts 0 and may block)
COUNTS = ([9, 8, 8, 6, 5, 5, 4, 3, 3, 2, 2, 1, 1, 1, 0], [7, 5, 3, 2, 1, 0])


def _scripted(ctx, window: int, threshold: int):
    """The decode loop of ``tail_decode.decode_until`` with scripted counts; returns the step found (-1: none), the
    collectives issued and the sum of an all-reduce issued after ``close`` (pairs only if the group is in step)."""
    import torch.distributed as dist

    from realloc.runtime.control.worker_tail import AsyncCounts

    k = dist.get_rank()
    mine = COUNTS[k]
    counts = AsyncCounts(dist.group.WORLD, 2, window)
    t, known, found = 0, 0, None
    while found is None:
        busy = t < len(mine) and (t == 0 or mine[t - 1] > 0)
        counts.post(mine[t] if t < len(mine) else 0)
        t += 1
        for left in counts.ready(block=not busy):
            if left <= threshold:
                found = (known, left)
                break
            known += 1
    counts.close()
    probe = torch.tensor([k + 1], dtype=torch.long)
    dist.all_reduce(probe)
    return (found[0] if found[1] > 0 else -1), counts.posted, int(probe.item())


def _lockstep(threshold: int) -> int:
    n = max(map(len, COUNTS))
    total = [sum(c[i] if i < len(c) else 0 for c in COUNTS) for i in range(n)]
    step = next(i for i, x in enumerate(total) if x <= threshold)
    return step if total[step] > 0 else -1


@pytest.mark.parametrize("window", [1, 3, 4, 16])
@pytest.mark.parametrize("threshold", [6, 3, 1, 0])
def test_windowed_counts_find_the_lockstep_point_on_both_replicas(pool, window, threshold):
    got = pool.run(_scripted, window, threshold)
    assert [g[0] for g in got] == [_lockstep(threshold)] * 2
    assert got[0][1] == got[1][1]  # the same collectives on both replicas
    assert [g[2] for g in got] == [3, 3]  # the all-reduce after close pairs with itself


def _two_replicas_in_windows(ctx, gconfig, threshold, delay, window):
    """test_tail_runahead's two replicas (asynchronous counts against a blocking all-reduce per step), the counts
    sent ``window`` steps per reduction."""
    from realloc.runtime.control.worker_tail import AsyncCounts

    before = AsyncCounts.__init__.__defaults__
    AsyncCounts.__init__.__defaults__ = (window,)
    try:
        return _two_replicas(ctx, gconfig, threshold, delay)
    finally:
        AsyncCounts.__init__.__defaults__ = before


@pytest.mark.parametrize("window", [2, 5])
def test_windowed_counts_over_a_real_generation_give_the_lockstep_rows_and_tokens(pool, window):
    from realloc.models.sampling import GenerationConfig
    from test_length_schedule import MAX_NEW, SCHEDULE

    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                               length_schedule=SCHEDULE)
    got = pool.run(_two_replicas_in_windows, gconfig, 3, 0.3, window)
    for lockstep, ahead, _, _ in got:
        _same(lockstep, ahead)
    assert got[0][2] == got[1][2]  # the same collectives on both replicas
    assert got[0][3] == got[1][3]  # the all-gather after close pairs up
