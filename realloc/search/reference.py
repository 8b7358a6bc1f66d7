"""Plain-Python reference of the C++ plan simulator (csrc/simulator.cpp).

Same rules, written the obvious way: explicit node objects, per-device queues, per-device
memory sums. Slow by design; tests check that the C++ engine agrees with it.

Augmented graph (realhf.txt §4, Figure 6), unrolled over K iterations. In every
iteration, for each call in topological order:
  1. if its model has several calls, a parameter-reallocation node: from the layout of the
     model's previous call (for its first call, its last call of the previous iteration) to
     the call's layout, after that call, on the union of both meshes; free if the layouts are
     equal (the runtime moves parameters along the chain of calls: a generation layout costs
     a move there and one back);
  2. one data-transfer node per incoming data edge, on the union of both meshes;
  3. the call node.
With bounded staleness eta > 0 (``staleness``; csrc/problem.h) the ``stale_calls`` (generation of a
trained model) leave their model's chain in step 1; before each comes its snapshot (a reallocation from home, the
chain's last call, to its layout), and the runtime's order between them, the train steps and the chain's first
node goes through gates that the plan's layouts open or close (``stale_reference.py``).
A transfer node of zero cost occupies no device; a pair cost not priced yet counts
as its table's provisional cost and makes the evaluation inexact. A node becomes ready
``dispatch_latency`` after the end of a call or (non-free) reallocation it depends on, and
at the end of a transfer it depends on.

Scheduling is event-driven: at its ready time a node is dispatched, i.e. queued on each of
its devices, in Algorithm 1's order (realhf-appendix.txt: smallest ready time; ties: data
transfers first, as the runtime's master sends a finished call's outputs on before anything
else its end unblocks, then the node numbered first, in the order above); it starts once it
is first in line on all its devices.
That is Algorithm 1. When hosts have fewer cores than devices (``shares_cores``), the b busy
devices of a host with c < b cores each run at rate c / b, a node at its slowest host's rate.
The steady-state time per iteration is (T_last - T_first) / (last - first), T_t being the last end time
of iteration t's nodes, over the priced window (``SearchProblem.priced_window``: warm-up iterations before it,
lookahead iterations after it that are simulated but not priced).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

from realloc.search.home_keep import skipped_returns
from realloc.search.problem import SearchProblem
from realloc.search.stale_reference import GATE, aliased, link_stale, push_before, stale_chains
from realloc.search.tail_reference import PART, PART_DATA, TAIL, TailView, rewire

CALL, REALLOC, DATA = 0, 1, 2


@dataclasses.dataclass
class _Node:
    kind: int
    call: int
    other: int  # realloc: the model's previous call; data: producing call; call: -1
    iteration: int
    cost: float = 0.0
    devices: frozenset[int] = frozenset()
    parents: list[int] = dataclasses.field(default_factory=list)
    children: list[int] = dataclasses.field(default_factory=list)
    joint: int = -1  # a fused pair's call node: the other call's node, with which it runs as one (fused_node.h)
    hold: frozenset[int] = frozenset()  # a migrating generation: devices kept until its TAIL node ends
    migrates: bool = False  # a migrating generation: its edges leave from its TAIL node

    @property
    def free(self) -> bool:
        """A transfer of zero cost: no request, no device."""
        return self.kind != CALL and self.cost == 0.0


def _in_place(p: SearchProblem, plan: Sequence[int], src: int, dst: int) -> bool:
    """A reallocation that copies every destination shard from the device's own source shard (the source holds
    the whole model on every device, the destination mesh lies inside it): it occupies the destination's devices
    only, as the runtime waits only for them (master_schedule._wait_realloc); csrc Problem::in_place."""
    a, b, i, k = p.candidates[src], p.candidates[dst], int(plan[src]), int(plan[dst])
    return bool(a.whole[i]) and a.dev_lo[i] <= b.dev_lo[k] and b.dev_hi[k] <= a.dev_hi[i]


def _build_nodes(p: SearchProblem, plan: Sequence[int], missing: set | None = None) -> list[_Node]:
    n, K = p.n_calls, p.n_iterations

    def cand(c: int) -> int:
        return int(plan[c])

    def mesh(c: int) -> frozenset[int]:
        k = p.candidates[c]
        return frozenset(range(int(k.dev_lo[cand(c)]), int(k.dev_hi[cand(c)])))

    def layout(c: int) -> int:
        return int(p.candidates[c].layout[cand(c)])

    def realloc_cost(src: int, dst: int) -> float:
        """Moving ``dst``'s model from ``src``'s layout to ``dst``'s (0 within one layout); an unknown price is
        recorded in ``missing``."""
        m, ls, ld = p.call_model[dst], layout(src), layout(dst)
        if ls == ld or dst in skipped:  # home kept them, the way back is skipped (search/home_keep.py)
            return 0.0
        cost, known = p.realloc_costs[m].get(ls, ld)
        if not known and missing is not None:
            missing.add((m, ls, ld))
        return cost

    def c_producer(c: int) -> int:
        """The producer of consumer ``c``'s tail split, or -1."""
        return p.data_edges[tails.split_of[c].edge][0] if c in tails.split_of else -1

    eta = p.staleness
    stale = set(p.stale_calls) if eta > 0 else set()
    stale_of = {c: st for st, _ in stale_chains(p) for c in st}
    model_calls = [[c for c in range(n) if p.call_model[c] == m and c not in stale] for m in range(len(p.model_home))]
    skipped = skipped_returns(p, plan)
    fused_cost: dict[int, float] = {}  # call -> its fused node's duration (csrc/fused_node.h)
    for k, f in enumerate(p.fused):
        if f.on(p, plan):
            i, j = cand(f.a), cand(f.b)
            cost, known = f.fused_time(p, i, j)
            extra_known = f.extra.get(i, j)[1]
            if missing is not None:
                missing.update({(p.n_tables + 2 * k, i, j)} if not known else set())
                missing.update({(p.n_tables + 2 * k + 1, i, j)} if not extra_known else set())
            fused_cost[f.a] = fused_cost[f.b] = cost
    nodes: list[_Node] = []
    index: dict[tuple[str, int, int], int] = {}
    tails = TailView(p, plan)  # long-tail migration (tail_reference.py)
    for t in range(K):
        for c in range(n):
            # bounded staleness: gates and the snapshot (stale_reference.py)
            push_before(nodes, index, p, c, t, lambda c, x, t: _Node(GATE, c, x, t),
                        lambda c, home, t: _Node(REALLOC, c, home, t, 0.0 if aliased(p, plan, c, stale_of[c]) else
                                                 realloc_cost(home, c),
                                                 mesh(c) if _in_place(p, plan, home, c) else mesh(home) | mesh(c)))
            seq = model_calls[p.call_model[c]]
            if c not in stale and len(seq) > 1:
                prev = seq[seq.index(c) - 1]  # the last call for the first one
                index["realloc", c, t] = len(nodes)
                on = mesh(c) if _in_place(p, plan, prev, c) else mesh(prev) | mesh(c)
                nodes.append(_Node(REALLOC, c, prev, t, realloc_cost(prev, c), on))
            for e, (u, v) in enumerate(p.data_edges):
                if v == c:
                    cost, known = p.data_costs[e].get(layout(u), layout(v))
                    if not known and missing is not None:
                        missing.add((p.n_models + e, layout(u), layout(v)))
                    split = tails.split(c) if c in tails.split_of and tails.split_of[c].edge == e else None
                    index["data", e, t] = len(nodes)
                    nodes.append(_Node(DATA, c, u, t, cost * split[0].share2[split[2]] if split else cost,
                                       mesh(u) | mesh(v)))
            split = tails.split(c)
            if c in tails.split_of:
                e, g = tails.split_of[c].edge, c_producer(c)
                cost = p.data_costs[e].get(layout(g), layout(c))[0] * split[0].share1[split[2]] if split else 0.0
                index["part_data", c, t] = len(nodes)
                nodes.append(_Node(PART_DATA, c, g, t, cost, mesh(c)))
                index["part", c, t] = len(nodes)
                nodes.append(_Node(PART, c, g, t, tails.part1(c) if split else 0.0, mesh(c)))
            index["call", c, t] = len(nodes)
            time = float(split[0].part2[cand(c), split[2]]) if split else float(p.candidates[c].time[cand(c)])
            nodes.append(_Node(CALL, c, -1, t, time, mesh(c), hold=tails.tail_devices(c) if tails.tail_time(c) else
                               frozenset(), migrates=tails.grid(c) >= 0))
            if c in fused_cost:
                nodes[-1].cost = fused_cost[c]
            if c in tails.columns:
                index["tail", c, t] = len(nodes)
                nodes.append(_Node(TAIL, c, -1, t, tails.tail_time(c)))

    for t in range(K):
        for f in p.fused:
            if f.a in fused_cost:
                x, y = index["call", f.a, t], index["call", f.b, t]
                nodes[x].joint, nodes[y].joint = y, x

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
        link_stale(index, p, plan, t, K, link)
        for u, v in p.order_edges:
            if u not in stale:
                link(index["call", u, t], index["call", v, t])
        if t + 1 < K:
            for u, v in p.carry_edges:
                if v not in stale:
                    link(index["call", u, t], index["call", v, t + 1])
        for u, v in p.carry_edges:  # into a stale call, 1 + eta iterations later (the runtime's lag)
            if v in stale and t + 1 + eta < K:
                link(index["call", u, t], index["call", v, t + 1 + eta])
    rewire(nodes, index, p, K)
    return nodes


def missing_pairs(p: SearchProblem, plan: Sequence[int]) -> set[tuple[int, int, int]]:
    """(table id, a, b) of every pair cost the plan needs that is not priced yet."""
    out: set[tuple[int, int, int]] = set()
    _build_nodes(p, plan, out)
    return out


def _host_loads(p: SearchProblem, devices: frozenset[int]) -> dict[int, int]:
    loads: dict[int, int] = {}
    for d in devices:
        loads[d // p.host_size] = loads.get(d // p.host_size, 0) + 1
    return loads


def schedule(p: SearchProblem, plan: Sequence[int]) -> list[dict]:
    """Every node with its start and end time, in node order (iteration, then the order above)."""
    nodes = _build_nodes(p, plan)
    ready = [0.0] * len(nodes)
    waiting_parents = [len(nd.parents) for nd in nodes]
    start = [0.0] * len(nodes)
    end = [0.0] * len(nodes)
    # ties in ready time: data transfers first (the master sends a finished call's outputs on before
    # dispatching what its end unblocks), then node order
    def key(i: int) -> tuple[int, int]:
        return (nodes[i].kind not in (DATA, TAIL), i)  # a TAIL node hands on the outputs (tail_reference.py)

    heap = [(0.0, key(i), i) for i, nd in enumerate(nodes) if not nd.parents]
    heapq.heapify(heap)
    queues: dict[int, list[int]] = {d: [] for d in range(p.n_devices)}  # per device, in dispatch order
    dispatched: list[int] = []  # queued, not started, in dispatch order
    finish: dict[int, float] = {}  # running node -> end time at its current rate
    rate: dict[int, float] = {}
    loads = [_host_loads(p, nd.devices) for nd in nodes]
    n_done = 0
    arrived: set[int] = set()  # a fused pair's call node that left the queue first waits for the other's

    def complete(i: int, t: float) -> None:
        nonlocal n_done
        j = nodes[i].joint
        if j >= 0 and j in arrived:  # the fused node ends both calls
            arrived.discard(j)
            start[j] = start[i]
            complete(j, t)
        end[i] = t
        n_done += 1
        nd = nodes[i]
        # a migrating generation's edges leave from its TAIL node, which carries the latency (tail_reference.py)
        lat = p.dispatch_latency if (nd.kind == CALL and not nd.migrates) or (
            nd.kind in (REALLOC, TAIL, PART) and not nd.free) else 0.0
        if nd.kind == TAIL:  # the generation's call node gives back the tail devices
            dequeue(nd.parents[0], nodes[nd.parents[0]].hold)
        for u in nd.children:
            ready[u] = max(ready[u], t + lat)
            waiting_parents[u] -= 1
            if waiting_parents[u] == 0:
                heapq.heappush(heap, (ready[u], key(u), u))

    def update_rates(now: float) -> None:
        """Processor sharing: a node whose rate changes keeps its remaining work, done at the new rate."""
        busy: dict[int, int] = {}
        for i in finish:
            for h, k in loads[i].items():
                busy[h] = busy.get(h, 0) + k
        for i in finish:
            r = 1.0
            if p.shares_cores:
                for h in loads[i]:
                    r = min(r, p.cores_per_node / busy[h])
            if r != rate[i]:
                finish[i] = now + (finish[i] - now) * rate[i] / r
                rate[i] = r

    def dequeue(i: int, devices: frozenset[int] | None = None) -> None:
        for d in nodes[i].devices if devices is None else devices:
            assert queues[d][0] == i
            queues[d].pop(0)

    def first_in_line(i: int) -> bool:
        return all(queues[d][0] == i for d in nodes[i].devices)

    def begin(i: int, now: float) -> bool:
        """Start node i; a node of no duration also ends now. Returns whether it ended."""
        start[i] = now
        if nodes[i].cost == 0.0:
            dequeue(i, nodes[i].devices - nodes[i].hold)
            complete(i, now)
            return True
        finish[i] = now + nodes[i].cost
        rate[i] = 1.0
        return False

    now = 0.0
    while True:
        # 1. what ends now leaves its queues
        for i in sorted(i for i, f in finish.items() if f <= now):
            del finish[i], rate[i]
            dequeue(i, nodes[i].devices - nodes[i].hold)
            complete(i, now)
        # 2. nodes already dispatched start when first in line on all their devices (a node of no
        #    duration ends at once and may let the next ones start)
        scan = True
        while scan:
            scan = False
            for i in list(dispatched):
                if first_in_line(i):
                    dispatched.remove(i)
                    if begin(i, now):
                        scan = True
                        break
        # 3. dispatch, one node at a time in Algorithm 1's order, everything ready by now
        while heap and heap[0][0] <= now:
            r, _, i = heapq.heappop(heap)
            if nodes[i].free:
                start[i] = r
                complete(i, r)
                continue
            if nodes[i].joint >= 0 and nodes[i].joint not in arrived:
                arrived.add(i)  # runs with the other call, once that is ready too
                continue
            for d in sorted(nodes[i].devices):
                queues[d].append(i)
            if first_in_line(i):
                begin(i, now)
            else:
                dispatched.append(i)
        update_rates(now)
        nxt = min([*finish.values(), heap[0][0] if heap else math.inf])
        if nxt == math.inf:
            break
        now = nxt
    assert n_done == len(nodes), "the augmented graph has a cycle"
    return [dict(kind=nd.kind, call=nd.call, other=nd.other, iteration=nd.iteration, start=start[i], end=end[i],
                 devices=nd.devices) for i, nd in enumerate(nodes)]


def stage_at(p: SearchProblem, plan: Sequence[int], c: int, x: int) -> int:
    """Call ``c``'s stage on device ``x`` of its mesh: the second model of a fused pair that is on runs its stages
    in reverse order on the pair's mesh, in all its calls there (graph/fused.second_model_meshes): the mesh's
    devices in the pair's pp groups, the groups in reverse order, the call's stages over that order."""
    k, i = p.candidates[c], int(plan[c])
    lo, hi, local = int(k.dev_lo[i]), int(k.dev_hi[i]), x - int(k.dev_lo[i])
    for f in p.fused:
        kb, j = p.candidates[f.b], int(plan[f.b])
        same_mesh = (lo, hi) == (int(kb.dev_lo[j]), int(kb.dev_hi[j]))
        if p.call_model[c] == p.call_model[f.b] and same_mesh and f.on(p, plan):
            groups = kb.pp(j)
            size = (hi - lo) // groups
            local = (groups - 1 - local // size) * size + local % size
            break
    return local // int(k.stage_width[i])


def device_memory(p: SearchProblem, plan: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Per device: static bytes, peak bytes, and the call whose dynamic memory makes the peak (-1 if none)."""
    static = [0] * p.n_devices
    dynamic = [0] * p.n_devices
    dyn_call = [-1] * p.n_devices
    own: dict[tuple[int, int], int] = {}  # (call, device) -> its dynamic bytes
    for c in range(p.n_calls):
        k, i = p.candidates[c], int(plan[c])
        lo, hi = int(k.dev_lo[i]), int(k.dev_hi[i])
        home = p.model_home[p.call_model[c]]
        copy = c != home and int(k.layout[i]) != int(p.candidates[home].layout[int(plan[home])])
        keep = copy and p.staleness > 0 and c in p.stale_calls  # generation's copy stays (bounded staleness)
        for x in range(lo, hi):
            stage = stage_at(p, plan, c, x)
            d = int(k.stage_memory(i, "dynamic")[stage])
            if c == home:
                static[x] += int(k.stage_memory(i, "static")[stage])
            elif keep:
                static[x] += int(k.stage_memory(i, "param")[stage])
            elif copy:
                d += int(k.stage_memory(i, "param")[stage])
            own[c, x] = d
            if d > dynamic[x]:
                dynamic[x] = d
                dyn_call[x] = c
    peak = [s + d for s, d in zip(static, dynamic)]
    for f in p.fused:  # a fused node: the larger of its calls' bytes plus what fusion adds (csrc/fused_node.h)
        if f.on(p, plan):
            k, i = p.candidates[f.a], int(plan[f.a])
            extra = int(f.extra.get(i, int(plan[f.b]))[0])
            for x in range(int(k.dev_lo[i]), int(k.dev_hi[i])):
                fused = static[x] + max(own[f.a, x], own[f.b, x]) + extra
                if fused > peak[x]:
                    peak[x], dyn_call[x] = fused, f.a
    return static, peak, dyn_call


def evaluate(p: SearchProblem, plan: Sequence[int]) -> dict:
    """Time, memory and cost of ``plan`` (one candidate index per call), like ``_C.Problem.evaluate``."""
    ends = [0.0] * p.n_iterations
    for r in schedule(p, plan):
        ends[r["iteration"]] = max(ends[r["iteration"]], r["end"])
    first, last = p.priced_window
    time = (ends[last] - ends[first]) / (last - first)
    _, peak, dyn_call = device_memory(p, plan)
    top = max(peak)
    dev = peak.index(top)
    if p.pool_start:  # heterogeneous pools: each device against its pool's memory
        excess = max(b - p.capacity(x) for x, b in enumerate(peak))
        overflow, feasible = max(0, excess), excess <= 0
    else:
        overflow = max(0, top - p.device_memory)
        feasible = top <= p.device_memory
    cost = time if feasible else time * p.oom_alpha * (1.0 + overflow / p.device_memory)
    return dict(time=time, makespan=ends[last], cost=cost, peak_memory=top, overflow=overflow, peak_device=dev,
                peak_call=dyn_call[dev], feasible=feasible, exact=not missing_pairs(p, plan))
