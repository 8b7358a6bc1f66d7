"""Fused train pairs in the plan space (rlhfuse.txt §5; csrc/fused_node.h, docs/fused-training.md): which pairs
the search may fuse, the bound on what fusing can save per candidate, and the price of one pair of candidates.

A pair enters the space only when some candidates of both calls share devices and pp (on any cluster: both
simulations, the event-driven one of devices sharing CPU cores too, run a fused pair as one node): a space
without eligible pairs is the space of before, plan for plan."""

from __future__ import annotations

import numpy as np

from realloc.estimator.cost import CostModel
from realloc.estimator.fused_cost import price_fused_placed
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.fused import fusable_pairs
from realloc.search.candidates import Candidate
from realloc.search.problem import FusedPairArrays, PairCosts, SearchProblem

# Annealing moves of the fused schedule search per priced pair of candidates (estimator/fused_cost.py).
SEARCH_ITERATIONS = 500


def bubble_bound(options: tuple[Candidate, ...], time: np.ndarray) -> np.ndarray:
    """Per candidate, at most what fusing can save of its time: the share of a pp-stage pipeline of m micro-batches
    that 1F1B leaves idle, (pp - 1) / (m + pp - 1), of the whole call (which also counts work outside the
    pipeline, so the bound is generous: it only stands in until the pair is priced)."""
    return np.asarray([float(t) * (s.pp - 1) / (m + s.pp - 1) for (_, s, m, *_), t in zip(options, time)], np.float64)


def fused_pair_arrays(graph: DataflowGraph, problem: SearchProblem,
                      options: tuple[tuple[Candidate, ...], ...]) -> tuple[FusedPairArrays, ...]:
    """The space's fused pairs: every pair of ``fusable_pairs`` with candidates that can share a mesh at pp > 1."""
    index = {c: i for i, c in enumerate(problem.call_names)}
    out = []
    for first, second in fusable_pairs(graph):
        a, b = index[first], index[second]
        ka, kb = problem.candidates[a], problem.candidates[b]
        # at pp 1 there are no bubbles to fill: fusing saves nothing
        where = {(int(ka.dev_lo[i]), int(ka.dev_hi[i]), ka.pp(i)) for i in range(len(ka)) if ka.pp(i) > 1}
        if not any((int(kb.dev_lo[j]), int(kb.dev_hi[j]), kb.pp(j)) in where for j in range(len(kb))):
            continue
        out.append(FusedPairArrays(a=a, b=b, bound_a=bubble_bound(options[a], ka.time),
                                   bound_b=bubble_bound(options[b], kb.time), saving=PairCosts(len(ka), len(kb)),
                                   extra=PairCosts(len(ka), len(kb))))
    return tuple(out)


def price_fused_entry(graph: DataflowGraph, cost: CostModel, problem: SearchProblem,
                      options: tuple[tuple[Candidate, ...], ...], pair: int, i: int, j: int) -> tuple[float, float]:
    """Seconds per iteration fused pair ``pair`` saves with candidates (i, j), and the activation bytes it adds
    (estimator/fused_cost.py)."""
    f = problem.fused[pair]
    (ma, sa, na, ra, _), (mb, sb, nb, rb, _) = options[f.a][i], options[f.b][j]
    # a short schedule search: within 0.1% of a long one's makespan at 65B/33B, pp 30, 32 micro-batches, in a third
    # of the time (the search prices pairs while its chains run)
    r = price_fused_placed(cost, problem.call_names[f.a], problem.call_names[f.b], (ma, sa, na, ra), (mb, sb, nb, rb),
                           iterations=SEARCH_ITERATIONS, memory_iterations=SEARCH_ITERATIONS // 2)
    return max(0.0, r.serial_time - r.time), float(r.extra_activation)

