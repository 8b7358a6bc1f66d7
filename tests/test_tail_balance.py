"""Tails (migration, streaming) with token-balanced dp ranks (``balance_tokens``; issue 31 items 3 and 4,
docs/tail-semantics.md): a split consumer's two parts are each dealt by tokens, and a run with the tail entry
equals the same balanced run without it (samples, metrics, the whole checkpoint), PPO migrating its tail and GRPO
streaming. The reference is the untailed *balanced* run: the train steps get the same token-balanced shares in
both, and their gradient sums depend on that dealing only through float order."""

from __future__ import annotations

import json
import re

import pytest
from test_stream_run import DEVICE_0
from test_streaming import N_ITER, R_T, _experiment, assert_inference_in_two_parts, assert_same_runs
from test_tail_stale import run_with

from realloc.graph.row_deal import deal_rows
from realloc.graph.streaming import deal
from realloc.graph.transfer_plan import dp_ranges
from realloc.lengths import ResponseLengths
from realloc.models.length_schedule import scheduled_lengths


def _ratio(shares, tokens) -> float:
    sums = [sum(tokens[i] for i in rows) for rows in shares]
    return max(sums) / min(sums)


@pytest.mark.parametrize("seed", range(4))
def test_parts_dealt_by_tokens_are_balanced_where_the_rows_allow(seed):
    """256 rows of lognormal lengths (p99 16x the median), the 20% longest still running at the split point: part 1
    and part 2 are each dealt as row lists with near-equal tokens (graph/row_deal.py; max/min <= 1.05: part 1 at
    dp 2, 4 and 8, part 2's 51 long rows at dp 2 and 4), never worse than the even deal."""
    lens = scheduled_lengths(ResponseLengths.lognormal(median=8, p99=128), 256, seed, range(256))
    tokens = {i: 16 + n for i, n in enumerate(lens)}
    order = sorted(range(256), key=lambda i: (lens[i], i))
    part1, part2 = sorted(order[:205]), sorted(order[205:])
    for part, dps in ((part1, (2, 4, 8)), (part2, (2, 4))):
        for dp in (2, 4, 8):
            shares = deal(part, dp, tokens)
            assert sorted(i for rows in shares for i in rows) == part and all(list(r) == sorted(r) for r in shares)
            assert _ratio(shares, tokens) <= _ratio(deal(part, dp), tokens) + 1e-12
            if dp in dps:
                assert _ratio(shares, tokens) <= 1.05, (dp, len(part))
    assert deal([5, 1], 2, {1: 3, 5: 9}) == ((1,), (5,)) and deal([], 2, {}) == ((), ())


CASES = {"ppo": ((R_T, 1), ("localhost", 2, 1, 1, 1)), "grpo": ((R_T, 0), DEVICE_0)}


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_tail_with_balanced_tokens_matches_the_balanced_run_without_it(tmp_path, algo):
    tail, mesh = CASES[algo]
    exp = _experiment(tmp_path, algo)
    text = exp.read_text()
    field = "    log_samples: int = 32\n"
    exp.write_text(text.replace(field, field + "    balance_tokens: bool = True\n"))
    assert exp.read_text() != text
    tailed = run_with(tmp_path, exp, "tailed", {"actor_gen": tail}, mesh, [])
    plain = run_with(tmp_path, exp, "plain", {}, mesh, [])
    assert_inference_in_two_parts(tailed)
    assert_same_runs(tailed, plain)
    # the train steps (dp 2) ran on the token-balanced row lists of each iteration's lengths, as without the tail
    samples = [json.loads(x) for x in (tailed / "samples.jsonl").read_text().splitlines()]
    unit = 1 if algo == "ppo" else 4
    for run in (tailed, plain):
        seen = {}
        for line in (run / "logs" / "worker0.log").read_text().splitlines():
            m = re.search(r"iteration (\d+) call (\w+_train) rows (\[.*\])", line)
            if m:
                seen[int(m.group(1)) - 1, m.group(2)] = tuple(tuple(r) for r in eval(m.group(3)))  # noqa: S307
        assert len(seen) == 2 * N_ITER if algo == "ppo" else N_ITER
        moved = False
        for (t, call), got in seen.items():
            rows = sorted((s for s in samples if s["iteration"] == t + 1 and "prompt_ids" in s), key=lambda s: s["seq"])
            tokens = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in rows]
            assert got == deal_rows(tokens, 2, unit=unit, n_minibatches=2, min_rows=1), (t, call)
            moved |= got != tuple(tuple(range(lo, hi)) for lo, hi in dp_ranges(len(tokens), 2))
        assert moved  # some iteration's balanced rows are not the even split
