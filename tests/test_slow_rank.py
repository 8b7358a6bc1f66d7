"""Issue 31: a packed call at dp > 1 ends with its slowest dp rank, the one holding the longest row, whose rows are
as wide as that row (estimator/packed_rows.slow_rank_shape). Against a hand-computed packing, against the runtime's
own dealing and packing of drawn lengths, and fixed lengths priced exactly as before."""

from __future__ import annotations

import statistics

import pytest

from realloc.calls import InterfaceType
from realloc.estimator.memory import Workload
from realloc.estimator.packed_rows import packed_shape, slow_rank_shape
from realloc.graph.row_deal import deal_rows
from realloc.lengths import ResponseLengths as R
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.packing import first_fit_decreasing
from realloc.models.weights import param_seed

FIT = R.lognormal(median=8, p99=128)  # bench_fusion.py --setting fit: 32 rows, 8-token prompts
LONG = R.lognormal(median=4, p99=128)  # --setting long: 128 rows, 32-token prompts


def test_the_slow_rank_by_hand():
    """fit's inference at dp 2 (16 rows a rank). Expected lengths of 16 responses: 1 2 3 3 4 5 6 8 9 11 14 17 22
    29 42 70; the longest of 32 is 90. Rows dealt evenly: the rank with the longest holds 15 rows like any rank's
    and the 90, so with 8-token prompts 98 | 50 + 37 + 11 | 30 + 25 + 22 + 19 | 17 + 16 + 14 + 13 + 12 + 11 + 9 | 10:
    5 rows of 98, where a rank's own longest (70) made 5 rows of 78 (``packed_shape``)."""
    assert FIT.order_statistics(128, 16) == (1, 2, 3, 3, 4, 5, 6, 8, 9, 11, 14, 17, 22, 29, 42, 70)
    assert FIT.order_statistics(128, 32)[-1] == 90
    assert packed_shape(FIT, 8, 128, 16) == (5, 78)
    assert slow_rank_shape(FIT, 8, 128, 16, 2, False) == (5, 98)
    # balance_tokens: deal_rows gives the 90 seven short rows (9 30 34 38 44 54 70 98 with prompts, 377 tokens,
    # about half of 760): 98 | 70 + 9 | 54 + 44 | 38 + 34 | 30, again 5 rows of 98; the other rank's 24 rows
    # (longest 28) pack into 15 rows of 28 = 420 slots against 490
    assert slow_rank_shape(FIT, 8, 128, 16, 2, True) == (5, 98)


def _drawn(lengths: R, prompt: int, rows: int, iterations: int = 8) -> list[list[int]]:
    """The sequence lengths the runs' length schedule draws (generation.py's seeds), prompt included."""
    return [[prompt + n for n in scheduled_lengths(lengths, 128, param_seed(1, f"generate/{t}"), range(rows))]
            for t in range(iterations)]


def _slowest_slots(seqs: list[int], dp: int, balanced: bool) -> int:
    """The most token slots (rows x longest) any dp rank's packed micro-batch takes, as the runtime deals the rows
    (contiguous even shares, or ``deal_rows`` with balance_tokens) and the engine packs them."""
    n = len(seqs) // dp
    shares = deal_rows(seqs, dp) if balanced else [range(r * n, (r + 1) * n) for r in range(dp)]
    slots = []
    for rows in shares:
        mine = [seqs[i] for i in rows]
        slots.append(len(first_fit_decreasing(mine, max(mine))) * max(mine))
    return max(slots)


@pytest.mark.parametrize("lengths,prompt,rows", [(FIT, 8, 32), (LONG, 32, 128)], ids=["fit", "long"])
@pytest.mark.parametrize("balanced", [False, True], ids=["even", "balance_tokens"])
def test_the_slowest_rank_takes_the_slots_the_runtime_packs(lengths, prompt, rows, balanced):
    """At dp 2, the estimate's slots within 15% of the mean over 8 drawn iterations of the slowest rank's packed
    slots, and closer to it than one rank's own packing (``packed_shape``, the rule before)."""
    measured = statistics.mean(_slowest_slots(s, 2, balanced) for s in _drawn(lengths, prompt, rows))
    r, w = slow_rank_shape(lengths, prompt, 128, rows // 2, 2, balanced)
    r0, w0 = packed_shape(lengths, prompt, 128, rows // 2)
    assert r * w == pytest.approx(measured, rel=0.15)
    assert abs(r * w - measured) <= abs(r0 * w0 - measured)


@pytest.mark.parametrize("balanced", [False, True], ids=["even", "balance_tokens"])
def test_a_train_mini_batch_at_dp_2(balanced):
    """long's train calls: 2 mini-batches of 64 rows (row i in mini-batch i mod 2), 32 a rank. The slowest rank
    within 15% of the runtime's, and never below one rank's own packing (the deal of the expected lengths alone
    evens the ranks out more than the drawn lengths' deal: 1540 slots against 1654 drawn and 1624 own)."""
    measured = statistics.mean(_slowest_slots(s[k::2], 2, balanced) for s in _drawn(LONG, 32, 128) for k in (0, 1))
    r, w = slow_rank_shape(LONG, 32, 128, 32, 2, balanced)
    assert r * w == pytest.approx(measured, rel=0.15)
    assert r * w >= (lambda s: s[0] * s[1])(packed_shape(LONG, 32, 128, 32))


def test_fixed_lengths_and_dp_1_price_as_before():
    fixed = Workload(InterfaceType.INFERENCE, n_seqs=32, n_steps=1, prompt_len=8, gen_len=128, balanced=True)
    assert fixed.packed(16, 2) == fixed.packed(16) == (16, 136)
    varied = Workload(InterfaceType.INFERENCE, n_seqs=32, n_steps=1, prompt_len=8, gen_len=128, lengths=FIT)
    assert varied.packed(16, 1) == packed_shape(FIT, 8, 128, 16)
    assert varied.packed(16, 2) == slow_rank_shape(FIT, 8, 128, 16, 2, False)
