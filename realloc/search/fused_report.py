"""What ``realloc search`` says about fused train pairs (rlhfuse.txt §5; docs/fused-training.md): for each pair of
train calls that could share one pipeline schedule, the searched (unfused) plan's time for the two next to the
fused schedule's, when the plan already puts them on one mesh with one pp. The search does not choose fusion
yet: the line says what fusing the pair in that plan would save on its mesh. ``fused_panel`` draws a fused
schedule as a timeline."""

from __future__ import annotations

from realloc.estimator.cost import CostModel
from realloc.estimator.fused_cost import price_fused_pair
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.fused import fusable_pairs
from realloc.graph.plan import ExecutionPlan
from realloc.search.fused_reference import Order, RefProblem, pass_times
from realloc.search.timeline import Box, Panel


def fused_summary(graph: DataflowGraph, cost: CostModel, plan: ExecutionPlan) -> list[str]:
    """One line per pair of train calls that could be fused (none for graphs with fewer than two)."""
    out = []
    for first, second in fusable_pairs(graph):
        pa, pb = plan.placements[first], plan.placements[second]
        if (pa.mesh, pa.pp) != (pb.mesh, pb.pp):
            out.append(f"fusion     {first} + {second}: not eligible in this plan (meshes {pa.mesh} / {pb.mesh}, "
                       f"pp {pa.pp} / {pb.pp}; fusing needs one mesh and one pp)")
            continue
        r = price_fused_pair(cost, plan, first, second)
        out.append(f"fusion     {first} + {second} on {pa.mesh} (pp {pa.pp}): {r.serial_time:.3f} s one after the "
                   f"other, {r.time:.3f} s fused ({r.speedup:.2f}x; schedule bound {r.bound_time:.3f} s), "
                   f"+{r.extra_activation / 2**30:.2f} GiB activations; set the plan's \"fused\" to use it")
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
