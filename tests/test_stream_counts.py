"""Streaming at dp >= 2 with the running-row counts as asynchronous windowed all-reduces
(``stream_decode.SplitGeneration.until_counted`` with ``worker_tail.AsyncCounts``; docs/streaming.md, "Faster fused
runs"), and the eager decoding's cheaper caches (``generation.drop_rows`` moves only the written slots, in place):
a replica decodes past a split point while the counts are in flight, yet every split point, every part's rows and
every token are those of the lockstep run (a blocking all-reduce per step) and of the plain generation."""

from __future__ import annotations

import time

import pytest
import torch

from model_helpers import build_model
from realloc.models.config import get_model_config
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_streaming import _prompts, _responses

THRESHOLDS = (6, 3, 1)  # three split points, then the rest


def _parts(ctx, gconfig, windowed: bool, delay: float):
    """Both replicas of dp 2 decode their halves to each split point and then to the end; replica 1 starts
    ``delay`` s late at every request. Returns, per part, the rows that ended in it (global ids) with their
    responses, the split points' counts, and the all-reduces issued."""
    import torch.distributed as dist

    from realloc.models.stream_decode import SplitGeneration
    from realloc.runtime.control.worker_tail import AsyncCounts

    model = build_model(ctx, get_model_config("tiny"), 2, 1, 1, seed=3)
    k, group = model.groups.dp_rank, model.groups.dp_group
    lo, hi = k * N_ROWS // 2, (k + 1) * N_ROWS // 2
    gen = SplitGeneration(model, _prompts()[lo:hi], gconfig, range(lo, hi), 2)
    issued = [0]

    def lockstep(local: int) -> int:
        t = torch.tensor([local], dtype=torch.long)
        dist.all_reduce(t, group=group)
        issued[0] += 1
        return int(t.item())

    parts, lefts, before = [], [], list(range(hi - lo))
    for threshold in THRESHOLDS:
        if k == 1:
            time.sleep(delay)
        if windowed:
            counts = AsyncCounts(group, 2)
            more = gen.until_counted(counts, threshold)
            issued[0] += counts.posted
        else:
            more = gen.until(lockstep, threshold)
        running = gen.running()
        done = [i for i in before if i not in running]
        parts.append(dict(zip([lo + i for i in done], _responses(gen.output(done))) if done else {}))
        lefts.append((more, gen.left))
        before = running
    gen.finish()
    parts.append(dict(zip([lo + i for i in before], _responses(gen.output(before))) if before else {}))
    probe = torch.tensor([k + 1], dtype=torch.long)  # the group is in step after the counts
    dist.all_reduce(probe, group=group)
    whole = _responses(model.generate([r.tolist() for r in _prompts()[lo:hi]], gconfig, seq_ids=range(lo, hi),
                                       n_mbs=2))
    return parts, lefts, issued[0], int(probe.item()), dict(zip(range(lo, hi), whole))


def _merged(results, i):
    out = {}
    for r in results:
        out.update(r[0][i])
    return out


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_windowed_counts_split_a_dp2_stream_where_lockstep_does_with_the_same_tokens(pool, delay):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                               length_schedule=SCHEDULE)
    late = pool.run(_parts, gconfig, True, delay)
    step = pool.run(_parts, gconfig, False, 0.0)
    lengths = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    # brute force: split point j is the first step (from the previous one on) leaving at most THRESHOLDS[j] rows
    want, s = [], 0
    for threshold in THRESHOLDS:
        s = next(t for t in range(s, MAX_NEW) if sum(n > t + 1 for n in lengths) <= threshold)
        want.append([i for i, n in enumerate(lengths) if n <= s + 1 and all(i not in w for w in want)])
    want.append([i for i in range(N_ROWS) if all(i not in w for w in want)])
    assert len({tuple(w) for w in want if w}) >= 3  # the parts differ: a real test of the split points
    for i, rows in enumerate(want):
        a, b = _merged(late, i), _merged(step, i)
        assert sorted(a) == sorted(b) == rows, i
        for r in rows:  # bit for bit: the same decode steps
            assert a[r][0] == b[r][0] and torch.equal(a[r][1], b[r][1]), (i, r)
    plain = {**late[0][4], **late[1][4]}
    for r in range(N_ROWS):
        got = next(_merged(late, i)[r] for i in range(len(want)) if r in want[i])
        assert got[0] == plain[r][0] and torch.equal(got[1], plain[r][1]), r
    assert [g[1] for g in late] == [g[1] for g in step] and late[0][1] == late[1][1]
    assert [g[3] for g in late + step] == [3] * 4  # every replica issued the same collectives
    assert late[0][2] == late[1][2] and step[0][2] == step[1][2] == s + 1  # one per step there


def test_dropping_finished_rows_moves_only_the_written_slots_of_a_shared_buffer():
    from realloc.models.generation import drop_rows
    from realloc.models.llama import KVCache

    g = torch.Generator().manual_seed(0)
    caches = [KVCache(torch.randn(5, 2, 9, 3, generator=g), torch.randn(5, 2, 9, 3, generator=g)) for _ in range(2)]
    want = [(c.k[[0, 2, 4]].clone(), c.v[[0, 2, 4]].clone()) for c in caches]
    keep = torch.tensor([True, False, True, False, True])
    out = drop_rows(caches, keep, used=4)
    for c, o, (k, v) in zip(caches, out, want):
        assert o.k.shape == (3, 2, 9, 3) and o.k.data_ptr() == c.k.data_ptr()  # in place, no new buffer
        assert torch.equal(o.k[:, :, :4], k[:, :, :4]) and torch.equal(o.v[:, :, :4], v[:, :, :4])
    whole = drop_rows([KVCache(k.clone(), v.clone()) for k, v in want], torch.tensor([False, True, True]))
    assert torch.equal(whole[0].k, want[0][0][1:]) and torch.equal(whole[1].v, want[1][1][1:])


def _stream_run(tmp_path):
    from test_streaming import _experiment, _run

    exp = _experiment(tmp_path, "ppo")
    # generation at dp 2 over both devices streaming in 2 chunks (the inference calls on device 1 run once,
    # after it: they share a device with replica 1), against the same plan without the entry
    return _run(tmp_path, exp, "streamed", {"actor_gen": (4, 0, 2)}), _run(tmp_path, exp, "plain", {})


def test_a_run_streamed_at_dp2_with_windowed_counts_matches_the_unstreamed_run(tmp_path):
    from test_streaming import assert_same_runs

    streamed, plain = _stream_run(tmp_path)
    log = (streamed / "logs" / "worker0.log").read_text()
    assert log.count("call actor_gen rows") >= 2 * 2  # split requests per iteration: the worker streamed
    assert_same_runs(streamed, plain)
