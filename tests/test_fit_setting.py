"""bench_fusion.py --setting fit (issue 31; docs/streaming.md, "A workload where fusion pays"): the ``mid`` CPU model
is priced from its own measured profile, and the benchmark's max/min tokens per dp rank line equals a brute-force
split of the same lengths."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_chunked  # noqa: E402

from realloc.estimator.hardware import shipped_profiles_dir  # noqa: E402
from realloc.estimator.profile_table import discover_profiles  # noqa: E402
from realloc.lengths import ResponseLengths  # noqa: E402
from realloc.models.config import get_model_config  # noqa: E402
from realloc.models.length_schedule import scheduled_lengths  # noqa: E402
from realloc.models.weights import param_seed  # noqa: E402


def test_mid_has_a_shipped_profile_for_actor_and_critic():
    tables = [t for t in discover_profiles("cpu", shipped_profiles_dir()) if t.model_type == "mid"]
    assert len(tables) == 1
    for name in ("mid", "mid-critic"):  # a profile matched by shape, or the estimate falls back to the roofline
        assert tables[0].matches("cpu", get_model_config(name), "fp32")
    assert not tables[0].matches("cpu", get_model_config("small"), "fp32")


def _best_two_way(tokens: list[int]) -> float:
    """The lowest max/min of any split of ``tokens`` into two sets (subset sums by dynamic programming)."""
    reach = 1
    for x in tokens:
        reach |= reach << x
    total = sum(tokens)
    return min(max(a, total - a) / min(a, total - a) for a in range(1, total) if reach >> a & 1)


def test_token_balance_lines_match_brute_force():
    """The dealing by rows and by contiguous token shares equal their brute-force worst over iterations 1-4; the
    row lists (what balance_tokens deals now) reach the best two-way split of each batch (within the search's
    stopping point, 1.0005) and stay within 1.05 where contiguous shares cannot."""
    report = bench_chunked.token_balance(32, 128, 4)
    spans = {name: [tuple(map(float, m)) for m in re.findall(r"([0-9.]+)-([0-9.]+)", line)][0]
             for name, line in ((n, next(x for x in report.splitlines() if x.strip().startswith(n)))
                                for n in ("contiguous by rows", "contiguous by tokens", "row lists by tokens"))}
    worst_rows, worst_contiguous, worst_best = 0.0, 0.0, 0.0
    for it in range(4):  # the lengths the runs generate (algorithms/common.py seeds the schedule per iteration)
        sched = ResponseLengths.lognormal(median=8, p99=128)
        tokens = [8 + n for n in scheduled_lengths(sched, 128, param_seed(1, f"generate/{it}"), range(32))]
        half = sum(tokens[:16]), sum(tokens[16:])
        worst_rows = max(worst_rows, max(half) / min(half))
        best = min(max(sum(tokens[:k]), sum(tokens[k:])) / min(sum(tokens[:k]), sum(tokens[k:])) for k in range(1, 32))
        worst_contiguous = max(worst_contiguous, best)
        worst_best = max(worst_best, _best_two_way(tokens))
    assert abs(spans["contiguous by rows"][1] - worst_rows) < 1e-3
    assert abs(spans["contiguous by tokens"][1] - worst_contiguous) < 1e-3  # the best contiguous split at dp 2
    assert spans["row lists by tokens"][1] <= max(worst_best, 1.0005) + 1e-3 <= 1.05 < worst_contiguous
