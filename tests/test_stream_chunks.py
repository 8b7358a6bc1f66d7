"""Chunked streaming (issue 31 item 2; a stream-only ``tail`` entry with ``chunks=k``, docs/tail-semantics.md): the
generation hands its finished rows on at k split points, consumers on other devices run on each chunk, and the run
equals the unstreamed one (samples, metrics, the whole checkpoint with optimizer state)."""

from __future__ import annotations

import re

import pytest
import torch

from realloc.graph.tail import TailMigration, split_thresholds
from realloc.lengths import ResponseLengths
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_streaming import N_ITER, R_T, _experiment, _responses, _run, assert_same_runs, model_and_plain

CHUNKS = 3


def test_split_thresholds_cut_the_rows_before_the_last_split_point_evenly():
    assert split_thresholds(32, 4, 1) == (4,)
    assert split_thresholds(32, 4, 4) == (25, 18, 11, 4)  # 28 rows in chunks of 7 (hand-computed)
    assert split_thresholds(10, 1, 3) == (7, 4, 1)
    assert TailMigration(rows=4, instances=0, chunks=3).model_dump() == {"rows": 4, "instances": 0, "chunks": 3}
    assert TailMigration(rows=4, instances=0).model_dump() == {"rows": 4, "instances": 0}  # the JSON of before


def _chunked(ctx, gconfig, thresholds, n_mbs, one_by_one: bool = False):
    from realloc.models.stream_decode import SplitGeneration

    got = model_and_plain(ctx, gconfig, n_mbs)
    if got is None:
        return None
    model, rows, plain = got
    return (plain, *split_at(SplitGeneration(model, rows, gconfig, range(N_ROWS), n_mbs, one_by_one), thresholds))


def split_at(gen, thresholds):
    """``gen`` (one replica: its count is the call's) split at each threshold, then finished: every row's response,
    the rows each split point handed on, the count after every step."""
    counts, out, chunks, before = [], {}, [], list(range(N_ROWS))
    for th in thresholds:
        gen.until(lambda n: counts.append(n) or n, th)
        done = [i for i in before if i not in gen.running()]
        out.update(zip(done, _responses(gen.output(done))))
        chunks.append(done)
        before = gen.running()
    gen.finish()
    out.update(zip(before, _responses(gen.output(before))))
    return out, chunks, counts


@pytest.mark.parametrize("n_mbs", [1, 3])
def test_a_generation_split_at_several_points_is_the_plain_one(pool, n_mbs):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(), temperature=0.9,
                               length_schedule=SCHEDULE)
    thresholds = split_thresholds(N_ROWS, 2, 4)
    plain, got, chunks, counts = next(r for r in pool.run(_chunked, gconfig, thresholds, n_mbs) if r)
    lengths = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    steps = [min(t for t in range(MAX_NEW) if sum(n > t + 1 for n in lengths) <= th) for th in thresholds]
    assert len(counts) == steps[-1] + 1  # one count per step; a split point an earlier step passed takes none
    prev = -1
    for step, chunk in zip(steps, chunks):  # chunk j: the rows that ended after split j - 1, up to split j
        assert chunk == [i for i, n in enumerate(lengths) if prev + 1 < n <= step + 1]
        prev = step
    for i, (tok, lp) in enumerate(plain):  # bit for bit: the same decode steps, nothing re-run
        assert got[i][0] == tok and torch.equal(got[i][1], lp), i


def logged_parts(log) -> dict[tuple[int, str], list[list[int]]]:
    """(iteration, call) -> the rows of each request a worker ran, from its log."""
    calls: dict[tuple[int, str], list[list[int]]] = {}
    for line in log.read_text().splitlines():
        m = re.search(r"iteration (\d+) call (\w+) rows (\[.*\])", line)
        if m:
            calls.setdefault((int(m.group(1)) - 1, m.group(2)), []).append(eval(m.group(3))[0])  # noqa: S307
    return calls


def chunk_parts(t: int) -> list[list[int]]:
    """The rows of each part a split consumer runs in iteration t of test_streaming's experiment streamed in CHUNKS
    chunks at R_T: the rows the EOS schedule ends between two split points, then the rest (empty parts left out)."""
    from realloc.models.weights import param_seed

    lengths = scheduled_lengths(ResponseLengths.lognormal(median=2, p99=14), 16, param_seed(1, f"generate/{t}"),
                                range(32))
    parts, prev = [], -1
    for th in split_thresholds(32, R_T, CHUNKS):
        step = min(s for s in range(16) if sum(n > s + 1 for n in lengths) <= th)
        parts.append([i for i, n in enumerate(lengths) if prev + 1 < n <= step + 1])
        prev = step
    parts.append([i for i, n in enumerate(lengths) if n > prev + 1])
    return [p for p in parts if p]


def test_a_run_streamed_in_chunks_matches_the_unstreamed_run(tmp_path):
    """PPO, generation at dp 1 on device 0, inference on device 1: each inference call runs once per chunk (of the
    rows finished between two split points) and once on the rest; the run equals the plain one."""
    exp = _experiment(tmp_path, "ppo")
    device_0 = ("localhost:0", 1, 1, 1, 1)
    chunked = _run(tmp_path, exp, "chunked", {"actor_gen": (R_T, 0, CHUNKS)}, device_0)
    plain = _run(tmp_path, exp, "plain", {}, device_0)
    calls = logged_parts(chunked / "logs" / "worker1.log")
    for t in range(N_ITER):
        want = chunk_parts(t)
        assert len(want) >= 3, want  # the test streams in more than two parts
        for c in ("rew_inf", "ref_inf", "critic_inf"):
            if (t, c) in calls:
                assert calls[t, c] == want, (t, c)
    assert {c for _, c in calls} >= {"ref_inf", "critic_inf"}
    assert_same_runs(chunked, plain)
