"""Bounded staleness in the Python plan simulator (``reference.py``), as the runtime orders it.

The runtime's rules (``runtime/control/master_schedule.py``: ``_snapshot_deps``, ``_stale_readers``; the C++ side
is ``csrc/stale.cpp``), for a model whose generation calls ``c`` (stale) run eta iterations ahead of its train
step (home, the last call of its chain), with one copy of the parameters per generation layout:

- the snapshot for ``c`` of iteration t copies the version after the train step of t - 1 - eta, once the stale
  calls of iteration t - 1 in the same layout have read the last copy; ``c`` of iteration t reads it;
- a generation in the train step's layout reads home in place: it has no snapshot, and waits for the train step of
  t - 1 - eta only;
- the model's first node of iteration s that changes home (``first``: the reallocation out of home, or the chain's
  first call) waits for what reads home's version s: the snapshots of iteration s + eta, and the stale calls of
  s + eta that read home in place; at the run's first iteration, for those of iterations 0 .. eta.

Which rule applies depends on the plan (the layouts), while the graph's edges do not. So every such edge goes
through a *gate*: a node without devices or time. A gate whose rule applies to the plan is closed (it waits for its
parents like any node); otherwise it is open: it is ready at 0 and ignores its parents. Per stale call, before its
call node: a gate ``in`` from each stale call of the model of the previous iteration (closed when both share a layout
other than home), a gate ``same`` from each earlier stale call's snapshot (same rule: a layout's one copy), then the
snapshot (its cost 0 in place and when an earlier stale call has the layout). Before the chain's first call: a gate
``place`` per stale call (closed when it reads home in place).
"""

from __future__ import annotations

from typing import Callable, Sequence

from realloc.search.problem import SearchProblem

GATE = 6  # node kind (csrc/problem.h NodeKind::kGate)


def stale_chains(p: SearchProblem) -> list[tuple[list[int], list[int]]]:
    """Per model with stale calls: (its stale calls, its chain of other calls), in topological order."""
    if p.staleness == 0:
        return []
    stale = set(p.stale_calls)
    out = []
    for m in range(p.n_models):
        calls = [c for c in range(p.n_calls) if p.call_model[c] == m]
        st = [c for c in calls if c in stale]
        if st:
            out.append((st, [c for c in calls if c not in stale]))
    return out


def layout_of(p: SearchProblem, plan: Sequence[int], c: int) -> int:
    return int(p.candidates[c].layout[int(plan[c])])


def shares_copy(p: SearchProblem, plan: Sequence[int], a: int, b: int, home: int) -> bool:
    """Stale calls ``a`` and ``b`` read one snapshot: one layout, not home's (gates ``in`` and ``same``)."""
    return layout_of(p, plan, a) == layout_of(p, plan, b) != layout_of(p, plan, home)


def in_place(p: SearchProblem, plan: Sequence[int], c: int, home: int) -> bool:
    """Stale call ``c`` reads home in place (gate ``place``)."""
    return layout_of(p, plan, c) == layout_of(p, plan, home)


def aliased(p: SearchProblem, plan: Sequence[int], c: int, stale: Sequence[int]) -> bool:
    """An earlier stale call of the model has ``c``'s layout: its snapshot is the copy ``c`` reads."""
    return any(layout_of(p, plan, x) == layout_of(p, plan, c) for x in stale[:stale.index(c)])


def push_before(nodes: list, index: dict, p: SearchProblem, c: int, t: int, make_gate: Callable,
                make_snapshot: Callable) -> None:
    """The nodes before call ``c``'s node in iteration t: gates ``place`` if ``c`` is a chain's first call; gates
    ``in`` and ``same`` and the snapshot if ``c`` is stale."""
    for st, chain in stale_chains(p):
        if c == chain[0]:
            for x in st:
                index["place", x, t] = len(nodes)
                nodes.append(make_gate(c, x, t))
        if c in st:
            for x in st:
                index["in", x, c, t] = len(nodes)
                nodes.append(make_gate(c, x, t))
            for x in st[:st.index(c)]:
                index["same", x, c, t] = len(nodes)
                nodes.append(make_gate(c, x, t))
            index["snapshot", c, t] = len(nodes)
            nodes.append(make_snapshot(c, chain[-1], t))


def link_stale(index: dict, p: SearchProblem, plan: Sequence[int], t: int, K: int,
               link: Callable[[int, int], None]) -> None:
    """Iteration t's edges of the staleness rules (the module docstring); an open gate gets no parents."""
    eta = p.staleness
    for st, chain in stale_chains(p):
        home = chain[-1]
        first = index.get(("realloc", chain[0], t), index["call", chain[0], t])
        for c in st:
            s = index["snapshot", c, t]
            if t - 1 - eta >= 0:
                link(index["call", home, t - 1 - eta], s)
            link(s, index["call", c, t])
            for x in st:
                g = index["in", x, c, t]
                if t >= 1 and shares_copy(p, plan, x, c, home):
                    link(index["call", x, t - 1], g)
                link(g, s)
            for x in st[:st.index(c)]:
                g = index["same", x, c, t]
                if shares_copy(p, plan, x, c, home):
                    link(index["snapshot", x, t], g)
                link(g, s)
        readers = [t + eta] if t > 0 else list(range(eta + 1))
        for c in st:
            g = index["place", c, t]
            for j in readers:
                if j < K:
                    link(index["snapshot", c, j], first)
                    if in_place(p, plan, c, home):
                        link(index["call", c, j], g)
            link(g, first)
