"""A home that keeps its parameters across a narrowing trip, as the planner sees it (docs/heterogeneous.md).

The runtime (``runtime/control/pool_dtypes.py``, ``DtypeRoutes``) keeps a model's parameters in its home layout
when a reallocation takes them to a pool whose dtype cannot hold them exactly (fp32 -> bf16, bf16 -> fp16,
fp16 -> bf16), and skips the reallocation that brings them back into home. The planner prices that skipped
reallocation at 0 (no request, no device), with the runtime's rule exactly (``csrc/home_keep.cpp`` is the same
rule; the tests compare both with the runtime's ``DtypeRoutes``):

- a model's chain is its calls without the stale ones; its home is the layout of the chain's last call;
- nothing is kept if a train call of the model runs outside home (the parameters change on the way);
- walking the reallocations from the one that wraps from the previous iteration, then in chain order, with
  ``kept`` false at first: a reallocation into home while ``kept`` is skipped (and clears it); otherwise one out
  of home into a pool of a narrower dtype sets ``kept``.

Memory: home's parameters are part of home's static memory in the planner (``estimator/memory.py`` rule 2),
counted on home's devices all the time, so the kept copy needs no extra term; the copy on the other pool is that
call's own (rule 3).
"""

from __future__ import annotations

from typing import Sequence

from realloc.cluster import ClusterSpec
from realloc.graph.dataflow import DataflowGraph


def narrows(src: str, dst: str) -> bool:
    """A trip from dtype ``src`` to ``dst`` (hardware names: fp32, bf16, fp16) rounds: ``dst`` cannot hold every
    value of ``src`` (``pool_dtypes.casts_exactly`` is its negation)."""
    return src != dst and dst != "fp32"


def home_keep_fields(cluster: ClusterSpec, graph: DataflowGraph, calls: Sequence[str]) -> dict:
    """``SearchProblem`` fields of the rule: empty unless some pair of pools narrows (one pool, one dtype: the
    problem of before, bit for bit)."""
    dtypes = [p.hardware.dtype for p in cluster.pools]
    table = tuple(tuple(narrows(a, b) for b in dtypes) for a in dtypes)
    if not any(any(row) for row in table):
        return {}
    return dict(pool_narrows=table, train_calls=tuple(i for i, c in enumerate(calls) if graph.call(c).is_train))


def skipped_returns(p, plan: Sequence[int]) -> frozenset[int]:
    """Calls whose incoming (chain) reallocation the runtime skips under ``plan`` (``p`` a ``SearchProblem``)."""
    if not p.pool_narrows:
        return frozenset()
    stale = set(p.stale_calls) if p.staleness > 0 else set()
    train = set(p.train_calls)

    def layout(c: int) -> int:
        return int(p.candidates[c].layout[int(plan[c])])

    def pool(c: int) -> int:
        lo = int(p.candidates[c].dev_lo[int(plan[c])])
        return max(i for i, start in enumerate(p.pool_start) if start <= lo)

    out: set[int] = set()
    for m in range(p.n_models):
        chain = [c for c in range(p.n_calls) if p.call_model[c] == m and c not in stale]
        if len(chain) < 2:
            continue
        home = layout(chain[-1])
        if any(c in train and layout(c) != home for c in chain):
            continue
        kept = False
        for i, c in enumerate(chain):
            prev = chain[i - 1]  # the last call for the first one: the wrap
            if layout(prev) == layout(c):
                continue
            if layout(c) == home and kept:
                out.add(c)
                kept = False
            elif layout(prev) == home and p.pool_narrows[pool(prev)][pool(c)]:
                kept = True
    return frozenset(out)
