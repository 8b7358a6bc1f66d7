"""Price of a fused train pair (rlhfuse.txt §5, intra-stage fusion; graph/fused.py says which pairs a plan may
fuse).

Two TRAIN_STEP calls on one mesh with one pp: the first call's stage k runs on the mesh's stage group k,
the second's on group pp - 1 - k, and each optimizer step's forward and backward passes of both run in one
order per stage group, found by ``realloc._C.FusedProblem.search`` (csrc/fused_schedule.h) from the
estimator's per-stage pass times (``CostModel.train_passes``). Everything else in the two calls (their
optimizer steps, the interface's host work, dispatch) stays as it is unfused, so

    fused time = serial time - n_steps * (alone_1 + alone_2 - makespan)

where alone_i is call i's pipeline part alone under 1F1B and makespan is the fused schedule's, both from the
same schedule model. Memory: a stage group holds, at the schedule's peak, the in-flight activations of both
models; ``extra_activation`` is what that adds over the larger of the two calls' own 1F1B peaks there.
"""

from __future__ import annotations

import dataclasses

from realloc import _C
from realloc.estimator.cost import CostModel
from realloc.graph.fused import fused_pair_error
from realloc.graph.plan import ExecutionPlan

Pass = tuple[int, int, int]  # (0 first call / 1 second call, backward 0/1, micro-batch)


@dataclasses.dataclass(frozen=True)
class FusedSchedule:
    """One optimizer step of both calls: the order of passes per stage group (the first call's stage index),
    its makespan and lower bound, each call's 1F1B pipeline time alone, activation bytes in flight per group."""

    order: tuple[tuple[Pass, ...], ...]
    makespan: float
    lower_bound: float
    alone: tuple[float, float]
    peak: tuple[float, ...]  # bytes per stage group, fused
    serial_peak: tuple[float, ...]  # bytes per stage group, the larger of the two calls' own 1F1B peaks


@dataclasses.dataclass(frozen=True)
class FusedPairCost:
    first: str
    second: str
    n_steps: int  # optimizer steps per call, each fused with one of the other call
    serial_time: float  # seconds, the two calls one after the other
    time: float  # seconds, fused
    bound_time: float  # seconds, were the schedule at its lower bound
    extra_activation: int  # bytes fusion adds on the most affected stage group
    schedule: FusedSchedule

    @property
    def speedup(self) -> float:
        return self.serial_time / self.time


def fused_schedule(first: tuple[list[float], list[float], list[int], int],
                   second: tuple[list[float], list[float], list[int], int], *, memory_cap: float | None = 1.3,
                   iterations: int = 4000, memory_iterations: int = 2000, seed: int = 0) -> FusedSchedule:
    """Search the order of one step's passes. Each model is (fwd seconds, bwd seconds, in-flight bytes per
    micro-batch, all per stage; micro-batches). ``memory_cap``: a stage group's activations at most this
    multiple of the serial 1F1B peak of the most loaded group, or that peak plus one micro-batch's activations
    of its most loaded stage, whichever is more (None: no cap). The second bound matters at pp 2 or 3 only,
    where 1F1B holds 2 or 3 micro-batches: there a 1.3x cap in whole micro-batches is no room at all, and
    filling the bubbles needs one more in flight (rlhfuse.txt Table 3: up to 1.47x the serial peak)."""
    (fa, ba, aa, ma), (fb, bb, ab, mb) = first, second
    if len(fa) != len(fb):
        raise ValueError(f"fused schedule: both calls need the same pp, got {len(fa)} and {len(fb)}")
    pp = len(fa)
    prob = _C.FusedProblem(pp, pp, ma, fa, ba, [float(x) for x in aa], pp, mb, fb, bb, [float(x) for x in ab])
    cap = float("inf")
    if memory_cap is not None:
        serial_peak = prob.search(iterations=0, memory_iterations=0, restarts=1)["serial"]["peak"]
        cap = max(memory_cap * serial_peak, serial_peak + max(max(aa), max(ab)))
    r = prob.search(iterations=iterations, memory_iterations=memory_iterations, seed=seed, memory_cap=cap)
    one, two = prob.alone_1f1b(0), prob.alone_1f1b(1)
    return FusedSchedule(order=tuple(tuple(map(tuple, s)) for s in r["order"]), makespan=r["eval"]["makespan"],
                         lower_bound=r["lower_bound"], alone=(one["makespan"], two["makespan"]),
                         peak=tuple(r["eval"]["device_peak"]),
                         serial_peak=tuple(max(x, y) for x, y in zip(one["device_peak"], two["device_peak"])))


def price_fused_pair(cost: CostModel, plan: ExecutionPlan, first: str, second: str, *,
                     memory_cap: float | None = 1.3, iterations: int = 4000, memory_iterations: int = 2000,
                     seed: int = 0) -> FusedPairCost:
    """Seconds and extra activation bytes of calls ``first`` and ``second`` fused under ``plan``'s placements
    (the plan need not list the pair in ``fused``)."""
    graph = cost.graph
    why = fused_pair_error(graph, plan.placements, first, second)
    if why:
        raise ValueError(f"price_fused_pair({first!r}, {second!r}): {why}")
    placed = [plan.placements[c] for c in (first, second)]
    return price_fused_placed(cost, first, second, *[(cost.cluster.mesh(p.mesh), p.strategy, p.n_mbs, p.recompute)
                                                     for p in placed], memory_cap=memory_cap, iterations=iterations,
                              memory_iterations=memory_iterations, seed=seed)


def price_fused_placed(cost: CostModel, first: str, second: str, place_first: tuple, place_second: tuple, *,
                       memory_cap: float | None = 1.3, iterations: int = 4000, memory_iterations: int = 2000,
                       seed: int = 0) -> FusedPairCost:
    """``price_fused_pair`` from each call's (mesh, strategy, n_mbs, recompute), both on one mesh with one pp
    (the search's candidates, search/fused_space.py)."""
    parts, serial = [], 0.0
    for call, (mesh, strategy, n_mbs, recompute) in ((first, place_first), (second, place_second)):
        parts.append((*cost.train_passes(call, mesh, strategy, n_mbs, recompute), n_mbs))
        serial += cost.call_cost(call, mesh, strategy, n_mbs, recompute).time
    sched = fused_schedule(parts[0], parts[1], memory_cap=memory_cap, iterations=iterations,
                           memory_iterations=memory_iterations, seed=seed)
    n_steps = cost.workload(first).n_steps
    alone = sum(sched.alone)
    extra = max(max(0.0, f - s) for f, s in zip(sched.peak, sched.serial_peak))
    return FusedPairCost(first=first, second=second, n_steps=n_steps, serial_time=serial,
                         time=serial - n_steps * (alone - sched.makespan),
                         bound_time=serial - n_steps * (alone - sched.lower_bound), extra_activation=int(extra),
                         schedule=sched)
