"""Plans and runs of experiments/ppo_tiny.py shared by the multi-process run tests."""

from __future__ import annotations

from pathlib import Path

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "experiments/ppo_tiny.py")

# Actor and critic on disjoint devices for inference, data-parallel actor training across both: the actor
# is reallocated every iteration and data crosses devices.
DISJOINT = {"actor_gen": ("localhost:0", 1), "rew_inf": ("localhost:0", 1), "ref_inf": ("localhost:1", 1),
            "critic_inf": ("localhost:1", 1), "actor_train": ("localhost", 2), "critic_train": ("localhost:1", 1)}


def disjoint_plan() -> ExecutionPlan:
    spec = load_experiment(TINY)
    g = build_graph(spec)
    return ExecutionPlan(experiment=spec.name, graph_digest=g.digest, nodelist=spec.cluster.nodelist,
                         n_devices_per_node=spec.cluster.n_devices_per_node, device=spec.cluster.device,
                         placements={c: CallPlacement(mesh=m, dp=dp, tp=1, pp=1, n_mbs=1)
                                     for c, (m, dp) in DISJOINT.items()}, source="hand")
