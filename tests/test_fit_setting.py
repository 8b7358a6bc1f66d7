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


def test_token_balance_line_matches_brute_force():
    line = bench_chunked.token_balance(32, 128, 4)
    by_rows, by_tokens = [tuple(map(float, m)) for m in re.findall(r"([0-9.]+)-([0-9.]+)", line)]
    worst_rows, worst_best = 0.0, 0.0
    for it in range(4):  # the lengths the runs generate (algorithms/common.py seeds the schedule per iteration)
        sched = ResponseLengths.lognormal(median=8, p99=128)
        tokens = [8 + n for n in scheduled_lengths(sched, 128, param_seed(1, f"generate/{it}"), range(32))]
        half = sum(tokens[:16]), sum(tokens[16:])
        worst_rows = max(worst_rows, max(half) / min(half))
        best = min(max(sum(tokens[:k]), sum(tokens[k:])) / min(sum(tokens[:k]), sum(tokens[k:])) for k in range(1, 32))
        worst_best = max(worst_best, best)
    assert abs(by_rows[1] - worst_rows) < 1e-3
    assert abs(by_tokens[1] - worst_best) < 1e-3  # dealt by tokens: the best contiguous split at dp 2
