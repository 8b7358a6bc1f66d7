"""The rows a packed micro-batch of varying lengths runs as, priced as the engine packs them (issue 31).

``models/packing.py`` packs a micro-batch first-fit decreasing into rows as wide as its longest sequence. Long rows
rarely share a row, so the rows are more than the tokens over the width: on ``bench_fusion.py --setting long``
(32-token prompts, responses lognormal median 4, p99 128) 32 sequences take 1616 token slots on average over the
runs' lengths, where tokens / width says 1392 (12 rows of 116) and first-fit decreasing over the expected order
statistics says 1624 (14 rows of 116); a migrated tail of its 13 longest rows, 1406 slots against 1216 and 1368
(docs/estimator.md, "Packed rows of a long tail"). This module runs the engine's packing on the expected lengths.
It is torch-free (the planner imports it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from realloc.graph.row_deal import deal_rows
from realloc.lengths import ResponseLengths

# Sequences packed for the estimate: a larger micro-batch packs this many expected lengths and scales the rows
# (first-fit decreasing is quadratic in the sequences; rows grow about linearly with them at a fixed width).
PACK_SAMPLE = 256


def ffd_row_count(lengths: Sequence[int], capacity: int) -> int:
    """The rows first-fit decreasing fills with ``lengths`` at ``capacity`` tokens a row (``packing.pack_layout``'s
    rule: longest first, each into the first row with room)."""
    free: list[int] = []
    for n in sorted((n for n in lengths if n > 0), reverse=True):
        k = next((k for k, f in enumerate(free) if f >= n), -1)
        if k < 0:
            free.append(capacity - n)
        else:
            free[k] -= n
    return len(free)


@lru_cache(maxsize=4096)
def packed_shape(lengths: ResponseLengths, prompt: int, gen_len: int, b: int) -> tuple[int, int]:
    """(rows, tokens per row) of ``b`` sequences of a ``prompt``-token prompt and responses from ``lengths``: rows
    as wide as the expected longest sequence, as many as first-fit decreasing fills with the expected order
    statistics (the b sorted lengths' expectations; PACK_SAMPLE of them, rows scaled, above PACK_SAMPLE)."""
    width = prompt + lengths.order_statistics(gen_len, b)[-1]
    k = min(b, PACK_SAMPLE)
    rows = ffd_row_count([prompt + n for n in lengths.order_statistics(gen_len, k)], width)
    return max(1, min(b, math.ceil(rows * b / k))), width



@lru_cache(maxsize=4096)
def slow_rank_shape(lengths: ResponseLengths, prompt: int, gen_len: int, b: int, dp: int,
                    balanced: bool) -> tuple[int, int]:
    """(rows, tokens per row) of the packed micro-batch of ``b`` sequences on the slowest of ``dp`` ranks (issue
    31): a call at dp > 1 ends when its slowest rank does, usually the rank holding the longest of the dp x b rows,
    whose rows are as wide as that row. Which rows each rank holds follows the runtime's dealing:

    - rows dealt evenly (the default): the rank with the longest row holds b - 1 rows like any rank's, the
      expected order statistics of b with the longest replaced by that of dp x b (``ResponseLengths.slowest_ends``,
      as a generation's slowest rank);
    - ``balance_tokens``: the master's ``row_deal.deal_rows`` on the dp x b expected order statistics (the rank
      with the longest row holds fewer, shorter rows besides it).

    Each rank's rows: first-fit decreasing at its longest; the rank with the most token slots (rows x width) is
    the slowest, never below one rank's own ``packed_shape``. Above PACK_SAMPLE sequences, PACK_SAMPLE of them
    (the longest still that of dp x b) and the rows scaled. At n_mbs > 1 every micro-batch is priced so (an upper
    bound: one of the slow rank's micro-batches holds the call's longest row)."""
    longest = lengths.order_statistics(gen_len, dp * b)[-1]
    if not balanced:
        k = min(b, PACK_SAMPLE)
        shares = [lengths.order_statistics(gen_len, k)[:-1] + (longest,)]
    else:
        k = max(1, min(b, PACK_SAMPLE // dp))
        ends = lengths.order_statistics(gen_len, dp * k)[:-1] + (longest,)
        shares = [tuple(ends[i] for i in rows) for rows in deal_rows([prompt + e for e in ends], dp)]
    # never below one rank's own packing: a deal of the expected lengths evens out the ranks more than the drawn
    # lengths' deal does (the long setting's train mini-batches, 32 a rank: 1540 slots, 1654 drawn, 1624 own)
    shapes = [packed_shape(lengths, prompt, gen_len, b)]
    for mine in shares:
        width = prompt + max(mine)
        rows = ffd_row_count([prompt + e for e in mine], width)
        shapes.append((max(1, min(b, math.ceil(rows * b / k))), width))
    return max(shapes, key=lambda s: (s[0] * s[1], s[1]))
