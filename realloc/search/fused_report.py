"""What ``realloc search`` says about fused train pairs (rlhfuse.txt §5; docs/fused-training.md): for each pair of
train calls that could share one pipeline schedule, the two calls' time one after the other next to the fused
schedule's when the plan puts them on one mesh with one pp: fused by the search (then beside the best plan found
without fusion), or not (then what fusing would save there). ``fused_panel`` draws a fused schedule as a
timeline."""

from __future__ import annotations

import dataclasses

import numpy as np

from realloc.estimator.cost import CostModel
from realloc.estimator.fused_cost import FusedPairCost, price_fused_pair
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.fused import fusable_pairs
from realloc.graph.plan import ExecutionPlan
from realloc.search.fused_reference import Order, RefProblem, pass_times
from realloc.search.timeline import Box, Panel, estimate_plan

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class FusedAlternative:
    """A plan with one pair of train calls co-placed and fused, estimated: ``serial_time`` is the simulator's
    iteration time with the pair co-placed but run one after the other, ``time`` the simulator's with the pair
    fused (csrc/fused_node.h; where the simulator has no fused node, on cores shared by devices or at pp 1, the
    serial time less the fused schedule's saving)."""

    plan: ExecutionPlan
    serial_time: float
    time: float
    peak_memory: int  # bytes, the simulated peak plus the activations fusion adds
    pair: FusedPairCost


def fused_alternative(graph: DataflowGraph, cost: CostModel, plan: ExecutionPlan, first: str,
                      second: str) -> FusedAlternative | None:
    """The better of ``plan`` with both calls on ``first``'s placement or on ``second``'s (each keeping its own
    recomputation choice), fused: one that fits the devices' memory first, then the faster; None if neither
    placement suits both calls."""
    def rank(a: FusedAlternative) -> tuple[bool, float]:  # fitting ones first, then the faster
        return a.peak_memory > graph.spec.cluster.device_memory, a.time

    best = None
    for src in dict.fromkeys((plan.placements[first], plan.placements[second])):
        places = dict(plan.placements)
        for c in (first, second):
            places[c] = src.model_copy(update={"recompute": plan.placements[c].recompute})
        alt = plan.model_copy(update={"placements": places, "fused": ()})
        try:
            space, idx = estimate_plan(graph, alt, cost)
        except ValueError:
            continue  # the placement does not suit the other call (its batch split, its model's shape)
        ev = space.evaluate(idx)
        pair = price_fused_pair(cost, alt, first, second)
        alt = alt.model_copy(update={"fused": ((first, second),)})
        time, peak = ev["time"] - (pair.serial_time - pair.time), int(ev["peak_memory"]) + pair.extra_activation
        if space.problem.fused:  # the simulator's fused node
            fused = space.evaluate(np.r_[idx[:space.problem.n_calls], 1].astype(np.int32))
            time, peak = fused["time"], int(fused["peak_memory"])
        cand = FusedAlternative(plan=alt, serial_time=ev["time"], time=time, peak_memory=peak, pair=pair)
        if best is None or rank(cand) < rank(best):
            best = cand
    return best


def fused_summary(graph: DataflowGraph, cost: CostModel, plan: ExecutionPlan,
                  estimated_time: float | None = None, unfused: ExecutionPlan | None = None) -> list[str]:
    """Lines per pair of train calls that could be fused (none for graphs with fewer than two): the pair's
    fused price where ``plan`` co-places it (beside ``unfused``, the best plan without fusion, where ``plan``
    fuses it), and otherwise the best co-placed fused alternative's estimate beside ``estimated_time``."""
    out = []
    for first, second in fusable_pairs(graph):
        pa, pb = plan.placements[first], plan.placements[second]
        if (first, second) in plan.fused:
            r = price_fused_pair(cost, plan, first, second)
            out.append(f"fusion     {first} + {second} fused on {pa.mesh} (pp {pa.pp}) by the search: training "
                       f"{r.serial_time:.3f} s one after the other, {r.time:.3f} s fused ({r.speedup:.2f}x; schedule "
                       f"bound {r.bound_time:.3f} s), +{r.extra_activation / GIB:.2f} GiB activations")
            if unfused is not None and estimated_time is not None:
                out.append(f"           best plan without fusion: {unfused.estimated_time:.3f} s/iteration (the fused "
                           f"plan {estimated_time:.3f} s: fusing makes the iteration "
                           f"{unfused.estimated_time / estimated_time:.3f}x as fast)")
            continue
        if (pa.mesh, pa.pp) == (pb.mesh, pb.pp):
            r = price_fused_pair(cost, plan, first, second)
            out.append(f"fusion     {first} + {second} on {pa.mesh} (pp {pa.pp}): {r.serial_time:.3f} s one after "
                       f"the other, {r.time:.3f} s fused ({r.speedup:.2f}x; schedule bound {r.bound_time:.3f} s), "
                       f"+{r.extra_activation / GIB:.2f} GiB activations; set the plan's \"fused\" to use it")
        else:
            out.append(f"fusion     {first} + {second}: not eligible in this plan (meshes {pa.mesh} / {pb.mesh}, "
                       f"pp {pa.pp} / {pb.pp}; fusing needs one mesh and one pp)")
        alt = fused_alternative(graph, cost, plan, first, second)
        if alt is None or estimated_time is None:
            continue
        p = alt.plan.placements[first]
        fits = alt.peak_memory <= graph.spec.cluster.device_memory
        out.append(f"           co-placed on {p.mesh} dp{p.dp}·tp{p.tp}·pp{p.pp}, {p.n_mbs} mb and fused: at best "
                   f"{alt.time:.3f} s/iteration ({alt.serial_time:.3f} s unfused there; searched plan "
                   f"{estimated_time:.3f} s), peak {alt.peak_memory / GIB:.2f} GiB/dev"
                   f"{'' if fits else ' (does not fit)'}")
    return out


def fused_panel(problem: RefProblem, order: Order, names: tuple[str, str] = ("A", "B"),
                title: str = "fused schedule") -> Panel:
    """The timeline panel of a fused order (timeline.write_timeline draws it): one row per device (stage group),
    one box per pass, coloured by model and direction, times from the reference evaluation."""
    times = pass_times(problem, order)
    if times is None:
        raise ValueError("fused_panel: the order deadlocks")
    kinds = tuple(f"{n} {k}" for n in names for k in ("forward", "backward"))
    boxes = tuple(Box(kind="call", label=kinds[2 * m + bw], lo=d, hi=d + 1, start=start, end=end, iteration=1,
                      detail=f"micro-batch {mb}")
                  for (d, (m, bw, mb)), (start, end) in sorted(times.items(), key=lambda kv: kv[1]))
    return Panel(title=title, boxes=boxes, iteration_ends=((1, max(e for _, e in times.values())),),
                 devices=tuple(f"device {d}" for d in range(problem.n_devices)), calls=kinds)
