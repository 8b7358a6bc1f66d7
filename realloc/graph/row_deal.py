"""Token-balanced data parallelism by row lists (issue 31, item 4): each dp rank of a call gets a LIST of the
batch's rows, chosen so that every rank holds about as many tokens as the others.

Contiguous shares (``row_balance.token_balanced_ranges``) cannot split a long row's excess: on 32 rows where two
rows hold a fifth of the tokens they stay 1.006-1.25 apart at dp 2. Any row list per rank is fine for the rest of
the runtime: the transfer planner moves lists (``DataLayout(rows=...)``), a worker reads and stores any rows
(``RunCall.rows``), a train step's mini-batch k is the rows with global index k mod ``n_minibatches`` wherever they
are (``algorithms/train_step.py``), and outputs are stored by global row index, so results are the unbalanced
run's up to float summation order.

The dealing (``deal_rows``) works on units: whole groups of ``unit`` responses to one prompt (a group baseline
needs its group on one rank). A unit's tokens are a vector over the mini-batches its rows fall in, and since every
mini-batch step synchronizes the ranks, the objective is the worst max/min tokens per rank over the mini-batches
(then the sum of squared relative deviations). Every rank keeps at least ``min_rows`` rows of every mini-batch.

- Small problems (at most ``EXACT_STATES`` assignments): exhaustive, the best achievable objective.
- Otherwise: two starts, the contiguous token-balanced shares (feasible whenever the batch is large enough) and
  the longest-processing-time-first greedy (each unit, heaviest first, to the rank it leaves least loaded), each
  improved by moves and swaps of units between two ranks (the heaviest and lightest of the worst mini-batch first)
  while the objective drops (or until max/min is within ``GOOD_ENOUGH``). Deterministic: ties go to the lower
  index.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from realloc.graph.row_balance import token_balanced_ranges

Shares = tuple[tuple[int, ...], ...]  # per dp rank, its rows (global sequence indices, ascending)

EXACT_STATES = 4096  # dp ** (units - 1) at most: solved exactly (a few ms)
_MAX_STEPS = 10_000
GOOD_ENOUGH = 1.0005  # the local search stops once max/min is this close to 1 (large batches get there fast)


def deal_rows(tokens: Sequence[int], dp: int, unit: int = 1, n_minibatches: int = 1, min_rows: int = 1) -> Shares:
    """Row lists for ``dp`` ranks with near-equal tokens per rank in every mini-batch (module docstring).

    ``tokens``: each row's tokens; ``unit``: rows per group (kept on one rank); ``n_minibatches``: a train step's
    mini-batches (row i is in mini-batch i mod n_minibatches; 1 for inference); ``min_rows``: the fewest rows of
    each mini-batch a rank may hold (the call's micro-batches). A batch too small for that minimum gets the
    contiguous shares of ``token_balanced_ranges`` (the even split)."""
    n = len(tokens)
    M = max(1, int(n_minibatches))
    if dp < 1 or unit < 1 or n % unit:
        raise ValueError(f"deal_rows: {n} rows cannot split into {dp} ranks of whole units of {unit}")
    start = token_balanced_ranges(tokens, dp, unit=unit, min_rows=M * min_rows)
    contiguous = tuple(tuple(range(lo, hi)) for lo, hi in start)
    n_units = n // unit
    weight = np.zeros((n_units, M))
    count = np.zeros((n_units, M), dtype=np.int64)
    for i, x in enumerate(tokens):
        weight[i // unit, i % M] += float(x)
        count[i // unit, i % M] += 1
    if dp == 1 or not _feasible(_owner(contiguous, unit, n_units), count, dp, min_rows):
        return contiguous
    best = None
    if dp ** (n_units - 1) <= EXACT_STATES:
        best = _exact(weight, count, dp, min_rows)
    if best is None:
        starts = [_owner(contiguous, unit, n_units)]
        greedy = _greedy(weight, dp)
        if _feasible(greedy, count, dp, min_rows):
            starts.append(greedy)
        found = [_improve(o, weight, count, dp, min_rows) for o in starts]
        best = min(found, key=lambda o: _objective(_loads(o, weight, dp)))
    return tuple(tuple(i for i in range(n) if best[i // unit] == r) for r in range(dp))


def worst_ratio(tokens: Sequence[int], shares: Sequence[Sequence[int]], n_minibatches: int = 1) -> float:
    """max/min tokens per rank, the worst over the mini-batches (row i in mini-batch i mod n_minibatches)."""
    M = max(1, int(n_minibatches))
    loads = np.zeros((len(shares), M))
    for r, rows in enumerate(shares):
        for i in rows:
            loads[r, i % M] += tokens[i]
    return _objective(loads)[0]


def _owner(shares: Shares, unit: int, n_units: int) -> np.ndarray:
    owner = np.zeros(n_units, dtype=np.int64)
    for r, rows in enumerate(shares):
        for i in rows[::unit]:
            owner[i // unit] = r
    return owner


def _loads(owner: np.ndarray, weight: np.ndarray, dp: int) -> np.ndarray:
    loads = np.zeros((dp, weight.shape[1]))
    np.add.at(loads, owner, weight)
    return loads


def _feasible(owner: np.ndarray, count: np.ndarray, dp: int, min_rows: int) -> bool:
    return bool((_loads(owner, count.astype(float), dp) >= min_rows).all())


def _objective(loads: np.ndarray) -> tuple[float, float]:
    """(worst max/min over the mini-batches, sum of squared deviations from each mini-batch's mean, relative)."""
    hi, lo, mean = loads.max(axis=0), loads.min(axis=0), loads.mean(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(lo > 0, hi / np.where(lo > 0, lo, 1.0), np.where(hi > 0, np.inf, 1.0))
        dev = np.where(mean > 0, (loads - mean) / np.where(mean > 0, mean, 1.0), 0.0)
    return float(ratio.max()), float((dev * dev).sum())


def _greedy(weight: np.ndarray, dp: int) -> np.ndarray:
    """Longest processing time first: units by total tokens, heaviest first, each to the rank whose worst
    mini-batch load relative to its target stays lowest (then the lighter rank, then the lower index)."""
    target = np.maximum(weight.sum(axis=0) / dp, 1e-12)
    loads = np.zeros((dp, weight.shape[1]))
    owner = np.zeros(weight.shape[0], dtype=np.int64)
    for u in sorted(range(weight.shape[0]), key=lambda u: (-weight[u].sum(), u)):
        after = ((loads + weight[u]) / target).max(axis=1)
        r = min(range(dp), key=lambda r: (after[r], loads[r].sum(), r))
        owner[u] = r
        loads[r] += weight[u]
    return owner


def _exact(weight: np.ndarray, count: np.ndarray, dp: int, min_rows: int) -> np.ndarray | None:
    """The best feasible assignment by enumeration (unit 0 on rank 0: the ranks are interchangeable), or None."""
    n_units = weight.shape[0]
    best, best_obj = None, None
    for rest in itertools.product(range(dp), repeat=n_units - 1):
        owner = np.array((0, *rest), dtype=np.int64)
        if not _feasible(owner, count, dp, min_rows):
            continue
        obj = _objective(_loads(owner, weight, dp))
        if best_obj is None or obj < best_obj:
            best, best_obj = owner, obj
    return best


def _improve(owner: np.ndarray, weight: np.ndarray, count: np.ndarray, dp: int, min_rows: int) -> np.ndarray:
    """Local search: the best move or swap of units between two ranks that lowers the objective, repeated."""
    owner = owner.copy()
    loads = _loads(owner, weight, dp)
    counts = _loads(owner, count.astype(float), dp)
    obj = _objective(loads)
    for _ in range(_MAX_STEPS):
        if obj[0] <= GOOD_ENOUGH:
            return owner
        k = int(np.argmax(loads.max(axis=0) / np.maximum(loads.min(axis=0), 1e-12)))
        a, b = int(np.argmax(loads[:, k])), int(np.argmin(loads[:, k]))
        pairs = [(a, b)] + [(a, r) for r in range(dp) if r not in (a, b)] + [(r, b) for r in range(dp) if r not in (a, b)]
        step = None
        for x, y in pairs:
            step = _best_exchange(owner, weight, count, loads, counts, x, y, min_rows, obj)
            if step is not None:
                break
        if step is None:
            return owner
        ux, uy, obj = step
        for u, src, dst in ((ux, x, y), (uy, y, x)):
            if u >= 0:
                owner[u] = dst
                loads[src] -= weight[u]
                loads[dst] += weight[u]
                counts[src] -= count[u]
                counts[dst] += count[u]
    return owner


def _best_exchange(owner: np.ndarray, weight: np.ndarray, count: np.ndarray, loads: np.ndarray,
                   counts: np.ndarray, x: int, y: int, min_rows: int, obj: tuple[float, float]
                   ) -> tuple[int, int, tuple[float, float]] | None:
    """The exchange between ranks x and y (unit i of x to y and unit j of y to x; -1: none) with the lowest
    objective, if below ``obj``: every move and swap at once, as arrays."""
    ux = np.concatenate([np.flatnonzero(owner == x), [-1]])
    uy = np.concatenate([np.flatnonzero(owner == y), [-1]])
    M = weight.shape[1]
    wz, cz = np.vstack([weight, np.zeros((1, M))]), np.vstack([count, np.zeros((1, M), dtype=np.int64)])
    d = wz[ux][:, None, :] - wz[uy][None, :, :]  # tokens x gives y, [i, j, mini-batch]
    dc = cz[ux][:, None, :] - cz[uy][None, :, :]
    lx, ly = loads[x] - d, loads[y] + d
    ok = ((counts[x] - dc) >= min_rows).all(axis=2) & ((counts[y] + dc) >= min_rows).all(axis=2)
    others = np.delete(loads, [x, y], axis=0)
    hi = np.maximum(lx, ly)
    lo = np.minimum(lx, ly)
    if len(others):
        hi, lo = np.maximum(hi, others.max(axis=0)), np.minimum(lo, others.min(axis=0))
    mean = loads.mean(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(lo > 0, hi / np.where(lo > 0, lo, 1.0), np.where(hi > 0, np.inf, 1.0)).max(axis=2)
        scale = np.where(mean > 0, mean, 1.0)
        rel = lambda v: np.where(mean > 0, (v - mean) / scale, 0.0)  # noqa: E731
        base = float((rel(others) ** 2).sum()) if len(others) else 0.0
        sq = base + (rel(lx) ** 2).sum(axis=2) + (rel(ly) ** 2).sum(axis=2)
    ratio = np.where(ok, ratio, np.inf)
    # lexicographic (ratio, squares): the lowest ratio, among those the fewest squares (a tolerance keeps float
    # noise in the ratio from hiding a better spread)
    r_best = ratio.min()
    if not np.isfinite(r_best):
        return None
    cand = ok & (ratio <= r_best * (1 + 1e-12))
    sq = np.where(cand, sq, np.inf)
    i, j = np.unravel_index(int(np.argmin(sq)), sq.shape)
    new = (float(ratio[i, j]), float(sq[i, j]))
    if not (new[0] < obj[0] * (1 - 1e-12) or (new[0] <= obj[0] * (1 + 1e-12) and new[1] < obj[1] - 1e-12)):
        return None
    return int(ux[i]), int(uy[j]), new
