"""Token-balanced data parallelism (issue 31, item 4): each dp rank of a call gets a share of the batch with
about as many tokens as the others, not as many rows. These are the contiguous shares; ``balance_tokens`` deals
row lists now (``row_deal.py``), which start from these shares and fall back to them on batches too small for the
per-rank minimum.

With long-tailed response lengths, dp ranks given equal row counts get very unequal work (packed micro-batches
cost about their tokens, ``models/packing.py``), and a call ends with its slowest rank. The shares stay
contiguous ranges of the batch, so the transfer planner (``transfer_plan.plan_data_transfer``), the workers'
data stores and the master's cache of who holds what are unchanged; only the boundaries move. Results do not
change beyond float summation order: inference is per row, and the train steps' mini-batches (global index
mod n_minibatches) and loss normalizations are over the whole batch, whatever rank holds a row
(``algorithms/train_step.py``).
"""

from __future__ import annotations

from typing import Sequence

from realloc.strategy import even_ranges


def token_balanced_ranges(tokens: Sequence[int], dp: int, unit: int = 1,
                          min_rows: int = 1) -> tuple[tuple[int, int], ...]:
    """Contiguous [lo, hi) shares of the batch for ``dp`` ranks, with near-equal sums of ``tokens`` (each row's).

    Boundaries fall on multiples of ``unit`` rows (a group of responses to one prompt stays on one rank), and
    every rank gets at least ``min_rows`` rows (rounded up to whole units; a train step needs each of its
    mini-batches and micro-batches non-empty). The boundaries minimize the largest deviation of a rank's tokens
    from the mean, each within a window around the unit boundary closest to its share (k / dp of the tokens).
    Contiguous shares cannot split a row, so a rank is off by up to about a row: on many rows per rank, a few
    percent at most. Equal row lengths, or a batch too small for the minimum, give the even split
    (``strategy.even_ranges``).
    """
    n = len(tokens)
    if dp < 1 or unit < 1 or n % unit:
        raise ValueError(f"token_balanced_ranges: {n} rows cannot split into {dp} ranks of whole units of {unit}")
    n_units = n // unit
    min_units = max(1, -(-min_rows // unit))
    if len(set(tokens)) <= 1 or n_units < dp * min_units:
        return even_ranges(n, dp)
    cum = [0]
    for u in range(n_units):
        cum.append(cum[-1] + sum(int(x) for x in tokens[u * unit:(u + 1) * unit]))
    mean = cum[-1] / dp
    first = [0]
    for k in range(1, dp):
        lo, hi = first[-1] + min_units, n_units - (dp - k) * min_units
        first.append(min(range(lo, hi + 1), key=lambda c: (abs(cum[c] - mean * k), c)))
    # Boundary k at the unit boundary closest to k / dp of the tokens is off by up to half the row there, and a
    # long row makes that a rank's several percent. So each boundary may move within a window around that
    # start, and a dynamic program over the boundaries picks the positions that minimize the largest
    # deviation of a rank's tokens from the mean (then the sum of squared deviations): the neighbours of a
    # long row share its excess.
    window = max(4, n_units // dp // 2)
    # best[c] = (worst deviation, squares, previous boundary) of the ranks before a boundary at unit c
    best: dict[int, tuple[float, float, int]] = {0: (0.0, 0.0, -1)}
    trail = []
    for k in range(1, dp + 1):
        if k == dp:
            cands = [n_units]
        else:
            cands = range(max(first[k] - window, k * min_units), min(first[k] + window, n_units - (dp - k) * min_units) + 1)
        nxt: dict[int, tuple[float, float, int]] = {}
        for c in cands:
            for a, (worst, sq, _) in best.items():
                if c - a < min_units:
                    continue
                dev = abs(cum[c] - cum[a] - mean)
                cand = (max(worst, dev), sq + dev * dev, a)
                if c not in nxt or cand[:2] < nxt[c][:2]:
                    nxt[c] = cand
        trail.append(nxt)
        best = nxt
    cuts = [n_units]
    for table in reversed(trail):
        cuts.append(table[cuts[-1]][2])
    cuts.reverse()
    return tuple((a * unit, b * unit) for a, b in zip(cuts[:-1], cuts[1:]))


def rank_tokens(tokens: Sequence[int], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Tokens per rank under ``ranges``."""
    return [sum(int(x) for x in tokens[lo:hi]) for lo, hi in ranges]


def row_runs(rows: Sequence[Sequence[int]], n: int, where: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's rows (global indices) as runs [lo, hi) of consecutive rows; the ranks' rows must be a
    partition of the batch's ``n`` (a ValueError naming ``where`` otherwise)."""
    seen = sorted(int(i) for r in rows for i in r)
    if seen != list(range(n)):
        raise ValueError(f"{where}: the ranks' row lists must hold each of the batch's {n} sequences exactly once")
    out = []
    for r in rows:
        runs: list[list[int]] = []
        for i in sorted(int(x) for x in r):
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        out.append(tuple((lo, hi) for lo, hi in runs))
    return tuple(out)
