"""What ``realloc search`` says about fused train pairs (rlhfuse.txt §5; docs/fused-training.md): for each pair of
train calls that could share one pipeline schedule, the searched (unfused) plan's time for the two next to the
fused schedule's, when the plan already puts them on one mesh with one pp. The search does not choose fusion
yet: the line says what fusing the pair in that plan would save on its mesh."""

from __future__ import annotations

from realloc.estimator.cost import CostModel
from realloc.estimator.fused_cost import price_fused_pair
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.fused import fusable_pairs
from realloc.graph.plan import ExecutionPlan


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
