"""Token balance by row lists (issue 31, item 4; graph/row_deal.py): the dealing against brute force on small
batches (the best achievable max/min per mini-batch), its constraints (whole groups, rows of every mini-batch on
every rank), and the long-tailed mixes of the benchmarks at <= 1.05 where contiguous shares are not."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from realloc.graph import row_deal
from realloc.graph.row_balance import token_balanced_ranges
from realloc.graph.row_deal import deal_rows, worst_ratio
from realloc.graph.streaming import deal
from realloc.graph.transfer_plan import dp_ranges
from realloc.lengths import ResponseLengths
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.weights import param_seed


def _brute_force(tokens, dp, unit, M, min_rows) -> float | None:
    """The lowest worst-over-mini-batches max/min tokens per rank of any dealing of whole units that leaves every
    rank at least ``min_rows`` rows of every mini-batch (None: no dealing does)."""
    n = len(tokens)
    best = None
    for owner in itertools.product(range(dp), repeat=n // unit):
        loads = [[0] * M for _ in range(dp)]
        rows = [[0] * M for _ in range(dp)]
        for i, x in enumerate(tokens):
            loads[owner[i // unit]][i % M] += x
            rows[owner[i // unit]][i % M] += 1
        if min(min(r) for r in rows) < min_rows:
            continue
        worst = max(max(loads[r][k] for r in range(dp)) / min(loads[r][k] for r in range(dp)) for k in range(M))
        best = worst if best is None else min(best, worst)
    return best


def _check_shape(shares, n, dp, unit, M, min_rows):
    assert len(shares) == dp and sorted(i for r in shares for i in r) == list(range(n))
    for rows in shares:
        assert list(rows) == sorted(rows)
        assert all(i // unit == rows[j - j % unit] // unit for j, i in enumerate(rows)), "whole groups"
        assert all(sum(i % M == k for i in rows) >= min_rows for k in range(M)), "rows of every mini-batch"


def _cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        dp = int(rng.integers(2, 4))
        unit, M = int(rng.choice([1, 2])), int(rng.choice([1, 2]))
        n_units = int(rng.integers(dp, 10 if dp == 2 else 7))
        min_rows = int(rng.choice([1, 1, 2]))
        tokens = [int(x) + 1 for x in np.exp(rng.normal(3, 1.3, size=n_units * unit))]  # long-tailed
        yield tokens, dp, unit, M, min_rows


def test_small_batches_get_the_best_dealing_by_brute_force():
    """Up to 9 units: the dealing reaches the best worst-mini-batch max/min of every feasible dealing."""
    checked = 0
    for tokens, dp, unit, M, min_rows in _cases(0, 150):
        best = _brute_force(tokens, dp, unit, M, min_rows)
        shares = deal_rows(tokens, dp, unit, M, min_rows)
        if best is None or not _contiguous_fits(tokens, dp, unit, M, min_rows):
            continue  # too few rows for the minimum: the contiguous fallback (below)
        _check_shape(shares, len(tokens), dp, unit, M, min_rows)
        assert worst_ratio(tokens, shares, M) == pytest.approx(best, rel=1e-12), (tokens, dp, unit, M, min_rows)
        checked += 1
    assert checked > 100


def _contiguous_fits(tokens, dp, unit, M, min_rows) -> bool:
    """Whether the contiguous token shares leave every rank ``min_rows`` of each mini-batch (else the dealing keeps
    them: a batch too small for the minimum)."""
    shares = token_balanced_ranges(tokens, dp, unit, M * min_rows)
    return all(sum(i % M == k for i in range(lo, hi)) >= min_rows for lo, hi in shares for k in range(M))


def test_the_local_search_is_near_the_best_on_small_batches(monkeypatch):
    """Without the exhaustive path (what batches of more than a few units get): never worse than the contiguous
    shares, the best dealing in at least 9 of 10 small batches, and within 5% of it in all but a few."""
    monkeypatch.setattr(row_deal, "EXACT_STATES", 0)
    n = best_hits = near = 0
    for tokens, dp, unit, M, min_rows in _cases(1, 150):
        best = _brute_force(tokens, dp, unit, M, min_rows)
        contiguous = token_balanced_ranges(tokens, dp, unit, M * min_rows)
        if best is None or not _contiguous_fits(tokens, dp, unit, M, min_rows):
            continue
        shares = deal_rows(tokens, dp, unit, M, min_rows)
        _check_shape(shares, len(tokens), dp, unit, M, min_rows)
        got = worst_ratio(tokens, shares, M)
        assert got <= worst_ratio(tokens, [range(lo, hi) for lo, hi in contiguous], M) * (1 + 1e-12)
        n += 1
        best_hits += got <= best * (1 + 1e-12)
        near += got <= best * 1.05
    assert n > 100 and best_hits >= 0.9 * n and near >= n - 3, (n, best_hits, near)


def test_too_few_rows_or_equal_lengths_keep_the_contiguous_split():
    assert deal_rows([7] * 10, 3) == tuple(tuple(range(lo, hi)) for lo, hi in dp_ranges(10, 3))
    # 2 ranks x 2 mini-batches x 3 rows need 12 rows: the even split, as contiguous shares do
    assert deal_rows([1, 9, 2, 8, 3, 7, 4, 6, 5, 5], 2, n_minibatches=2, min_rows=3) == ((0, 1, 2, 3, 4),
                                                                                        (5, 6, 7, 8, 9))
    assert deal_rows([5, 1, 1], 1) == ((0, 1, 2),)
    with pytest.raises(ValueError, match="whole units of 3"):
        deal_rows([1, 2, 3, 4], 2, unit=3)
    # a split consumer's part dealt by tokens: lists of the part's rows
    assert deal([9, 1, 7, 3], 2, {1: 10, 3: 1, 7: 1, 9: 10}) == ((1, 3), (7, 9))


LONG_TAIL = ResponseLengths.lognormal(median=64, p99=1024)


@pytest.mark.parametrize("seed", range(3))
def test_512_lognormal_responses_within_half_a_percent_and_per_mini_batch(seed):
    """512 responses, p99 16x the median: inference within 1.005 at dp 2, 4, 8 (contiguous shares: up to 1.1);
    a train step of 4 mini-batches in groups of 4 responses within 1.05 per mini-batch at dp 2 and 4."""
    tokens = [32 + n for n in scheduled_lengths(LONG_TAIL, 2048, seed=seed, seq_ids=range(512))]
    for dp in (2, 4, 8):
        shares = deal_rows(tokens, dp)
        _check_shape(shares, 512, dp, 1, 1, 1)
        assert worst_ratio(tokens, shares) <= 1.005
    for dp in (2, 4):
        shares = deal_rows(tokens, dp, unit=4, n_minibatches=4, min_rows=2)
        _check_shape(shares, 512, dp, 4, 4, 2)
        assert worst_ratio(tokens, shares, 4) <= 1.05


def test_the_fusion_benchmarks_mix_is_within_5_percent_at_dp_2_where_contiguous_shares_are_not():
    """bench_fusion.py's batch: 32 rows of 8 prompt tokens + lognormal(median 8, p99 128) of at most 128, as the
    EOS schedule draws them per iteration, 40 experiment seeds x 4 iterations: inference and each of a train
    step's 2 mini-batches within 1.05 at dp 2; contiguous token shares reach 1.25 and more."""
    sched = ResponseLengths.lognormal(median=8, p99=128)
    worst, contiguous = 1.0, 1.0
    for seed in range(1, 41):
        for it in range(4):
            tokens = [8 + n for n in scheduled_lengths(sched, 128, param_seed(seed, f"generate/{it}"), range(32))]
            inference, train = deal_rows(tokens, 2), deal_rows(tokens, 2, n_minibatches=2)
            _check_shape(train, 32, 2, 1, 2, 1)
            worst = max(worst, worst_ratio(tokens, inference), worst_ratio(tokens, train, 2))
            contiguous = max(contiguous, worst_ratio(tokens, [range(a, b) for a, b in token_balanced_ranges(tokens, 2)]))
    assert worst <= 1.05 < 1.25 <= contiguous, (worst, contiguous)
