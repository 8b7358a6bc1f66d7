"""Plain-Python reference of the C++ plan simulator (csrc/simulator.cpp).

Same rules, written the obvious way: explicit node objects, one free-time per device,
per-device memory sums. Slow by design; tests check that the C++ engine agrees with it.

Augmented graph (realhf.txt §4, Figure 6), unrolled over K iterations. In every
iteration, for each call in topological order:
  1. a parameter-reallocation node if the call is not its model's home call: from the
     home layout to the call's layout, after the model's previous call (across the
     iteration boundary for the model's first call), on the union of both meshes;
  2. one data-transfer node per incoming data edge, on the union of both meshes;
  3. the call node.
A transfer node of zero cost occupies no device; a pair cost not priced yet counts
as its table's provisional cost and makes the evaluation inexact. Scheduling is Algorithm 1
(realhf-appendix.txt): take the ready node with the smallest ready time (ties: the
node numbered first, in the order above), start it once all its devices are free.
The steady-state time per iteration is (T_K - T_1) / (K - 1), T_t being the last end
time of iteration t's nodes.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

from realloc.search.problem import SearchProblem

CALL, REALLOC, DATA = 0, 1, 2


@dataclasses.dataclass
class _Node:
    kind: int
    call: int
    other: int  # realloc: home call; data: producing call; call: -1
    iteration: int
    cost: float = 0.0
    devices: frozenset[int] = frozenset()
    parents: list[int] = dataclasses.field(default_factory=list)
    children: list[int] = dataclasses.field(default_factory=list)


def _build_nodes(p: SearchProblem, plan: Sequence[int], missing: set | None = None) -> list[_Node]:
    n, K = p.n_calls, p.n_iterations

    def cand(c: int) -> int:
        return int(plan[c])

    def mesh(c: int) -> frozenset[int]:
        k = p.candidates[c]
        return frozenset(range(int(k.dev_lo[cand(c)]), int(k.dev_hi[cand(c)])))

    def layout(c: int) -> int:
        return int(p.candidates[c].layout[cand(c)])

    model_calls = [[c for c in range(n) if p.call_model[c] == m] for m in range(len(p.model_home))]
    nodes: list[_Node] = []
    index: dict[tuple[str, int, int], int] = {}
    for t in range(K):
        for c in range(n):
            home = p.model_home[p.call_model[c]]
            if c != home:
                lh, lc = layout(home), layout(c)
                cost = 0.0
                if lh != lc:
                    cost, known = p.realloc_costs[p.call_model[c]].get(lh, lc)
                    if not known and missing is not None:
                        missing.add((p.call_model[c], lh, lc))
                index["realloc", c, t] = len(nodes)
                nodes.append(_Node(REALLOC, c, home, t, cost, mesh(home) | mesh(c)))
            for e, (u, v) in enumerate(p.data_edges):
                if v == c:
                    cost, known = p.data_costs[e].get(layout(u), layout(v))
                    if not known and missing is not None:
                        missing.add((p.n_models + e, layout(u), layout(v)))
                    index["data", e, t] = len(nodes)
                    nodes.append(_Node(DATA, c, u, t, cost, mesh(u) | mesh(v)))
            index["call", c, t] = len(nodes)
            nodes.append(_Node(CALL, c, -1, t, float(p.candidates[c].time[cand(c)]), mesh(c)))

    def link(a: int, b: int) -> None:
        if b not in nodes[a].children:
            nodes[a].children.append(b)
            nodes[b].parents.append(a)

    for t in range(K):
        for c in range(n):
            if ("realloc", c, t) in index:
                seq = model_calls[p.call_model[c]]
                i = seq.index(c)
                r = index["realloc", c, t]
                if i > 0:
                    link(index["call", seq[i - 1], t], r)
                elif t > 0:
                    link(index["call", seq[-1], t - 1], r)
                link(r, index["call", c, t])
        for e, (u, v) in enumerate(p.data_edges):
            d = index["data", e, t]
            link(index["call", u, t], d)
            link(d, index["call", v, t])
        for u, v in p.order_edges:
            link(index["call", u, t], index["call", v, t])
        if t + 1 < K:
            for u, v in p.carry_edges:
                link(index["call", u, t], index["call", v, t + 1])
    return nodes


def missing_pairs(p: SearchProblem, plan: Sequence[int]) -> set[tuple[int, int, int]]:
    """(table id, a, b) of every pair cost the plan needs that is not priced yet."""
    out: set[tuple[int, int, int]] = set()
    _build_nodes(p, plan, out)
    return out


def schedule(p: SearchProblem, plan: Sequence[int]) -> list[dict]:
    """Every node with its start and end time, in the order Algorithm 1 schedules them."""
    nodes = _build_nodes(p, plan)
    free = [0.0] * p.n_devices
    ready = [0.0] * len(nodes)
    waiting = [len(nd.parents) for nd in nodes]
    queue = [(0.0, i) for i, nd in enumerate(nodes) if not nd.parents]
    heapq.heapify(queue)
    out = []
    while queue:
        r, i = heapq.heappop(queue)
        nd = nodes[i]
        if nd.kind != CALL and nd.cost == 0.0:
            start = end = r
        else:
            start = r
            for d in sorted(nd.devices):
                start = max(start, free[d])
            end = start + nd.cost
            for d in nd.devices:
                free[d] = end
        out.append(dict(kind=nd.kind, call=nd.call, other=nd.other, iteration=nd.iteration, start=start, end=end,
                        devices=nd.devices))
        for u in nd.children:
            ready[u] = max(ready[u], end)
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(queue, (ready[u], u))
    assert len(out) == len(nodes), "the augmented graph has a cycle"
    return out


def device_memory(p: SearchProblem, plan: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Per device: static bytes, peak bytes, and the call whose dynamic memory makes the peak (-1 if none)."""
    static = [0] * p.n_devices
    dynamic = [0] * p.n_devices
    dyn_call = [-1] * p.n_devices
    for c in range(p.n_calls):
        k, i = p.candidates[c], int(plan[c])
        lo, hi, w = int(k.dev_lo[i]), int(k.dev_hi[i]), int(k.stage_width[i])
        home = p.model_home[p.call_model[c]]
        copy = c != home and int(k.layout[i]) != int(p.candidates[home].layout[int(plan[home])])
        for x in range(lo, hi):
            stage = (x - lo) // w
            d = int(k.stage_memory(i, "dynamic")[stage])
            if c == home:
                static[x] += int(k.stage_memory(i, "static")[stage])
            elif copy:
                d += int(k.stage_memory(i, "param")[stage])
            if d > dynamic[x]:
                dynamic[x] = d
                dyn_call[x] = c
    return static, [s + d for s, d in zip(static, dynamic)], dyn_call


def evaluate(p: SearchProblem, plan: Sequence[int]) -> dict:
    """Time, memory and cost of ``plan`` (one candidate index per call), like ``_C.Problem.evaluate``."""
    K = p.n_iterations
    ends = [0.0] * K
    for r in schedule(p, plan):
        ends[r["iteration"]] = max(ends[r["iteration"]], r["end"])
    time = (ends[K - 1] - ends[0]) / (K - 1)
    _, peak, dyn_call = device_memory(p, plan)
    top = max(peak)
    dev = peak.index(top)
    overflow = max(0, top - p.device_memory)
    feasible = top <= p.device_memory
    cost = time if feasible else time * p.oom_alpha * (1.0 + overflow / p.device_memory)
    return dict(time=time, makespan=ends[K - 1], cost=cost, peak_memory=top, overflow=overflow, peak_device=dev,
                peak_call=dyn_call[dev], feasible=feasible, exact=not missing_pairs(p, plan))
