"""Candidate placements of one call: every (mesh, strategy, n_mbs, recompute) the cluster allows, and pruning.

Pruning (``prune``) removes candidates that no plan can use or that no plan would
pick, so the search never spends evaluations on them:

1. memory: a candidate whose own footprint exceeds device memory on some pipeline
   stage never runs. For a model's home call the footprint is its static memory plus
   its dynamic memory; for any other call it is its dynamic memory plus the
   parameters (either a reallocated copy, or the home layout's static memory, which
   holds at least the parameters). Other models can only add to it.
2. dominated micro-batch counts and recomputation: candidates with the same mesh and
   strategy (and offload choice) have the same layout, hence the same transfer costs and
   static memory; an (n_mbs, recompute) that is no faster and needs no less dynamic
   memory on every stage than another one is never better.

A TRAIN_STEP call of a model may recompute activations (``ParallelModel.train_step``):
each of its (mesh, strategy, n_mbs) comes with and without recomputation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from realloc.cluster import ClusterSpec, DeviceMesh
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import CallPlacement
from realloc.strategy import ParallelStrategy, enumerate_strategies, micro_batch_options

# realhf.txt Table 4 uses up to 16 micro-batches; 64 leaves room for deep pipelines.
MAX_N_MBS = 64

class Option(NamedTuple):
    """One placement of a call (a CallPlacement with its mesh parsed)."""

    mesh: DeviceMesh
    strategy: ParallelStrategy
    n_mbs: int
    recompute: bool = False


class Candidate(NamedTuple):
    """A call's placement (``candidates.Option``) and whether its (frozen) model waits in host memory
    between its calls (ExecutionPlan.offload)."""

    mesh: DeviceMesh
    strategy: ParallelStrategy
    n_mbs: int
    recompute: bool
    offload: bool

    @property
    def option(self) -> Option:
        return Option(self.mesh, self.strategy, self.n_mbs, self.recompute)

    def describe(self) -> str:
        return (f"mesh {self.mesh.name} {self.strategy} n_mbs={self.n_mbs}{' recompute' if self.recompute else ''}"
                f"{' offloaded' if self.offload else ''}")


@dataclasses.dataclass(frozen=True)
class CallCosts:
    """Time and per-stage memory of every option of one call, before numbering."""

    options: tuple[Candidate, ...]
    time: np.ndarray
    static: tuple[np.ndarray, ...]  # per option, per stage bytes if this call holds the model's static memory
    dynamic: tuple[np.ndarray, ...]
    param: tuple[np.ndarray, ...]


def recompute_choices(graph: DataflowGraph, call: str) -> tuple[bool, ...]:
    """Training a model may recompute activations; nothing else keeps activations for a backward."""
    return (False, True) if graph.model_config(call) is not None and graph.call(call).is_train else (False,)


def call_options(graph: DataflowGraph, call: str, cluster: ClusterSpec | None = None,
                 max_n_mbs: int = MAX_N_MBS) -> list[Option]:
    """All placements of ``call`` before any memory pruning."""
    cluster = cluster or graph.spec.cluster
    cfg = graph.model_config(call)
    n_seqs = graph.steps_n_seqs(call)
    recompute = recompute_choices(graph, call)
    out = []
    for mesh in cluster.device_meshes():
        if cfg is None:
            # A rule function runs once per dp rank, with no model to shard.
            strategies = [ParallelStrategy(mesh.size, 1, 1)] if n_seqs % mesh.size == 0 else []
        else:
            strategies = list(enumerate_strategies(cfg, mesh.size, mesh.n_devs, n_seqs))
        for s in strategies:
            if graph.dp_error(s.dp):
                continue
            for m in micro_batch_options(n_seqs, s.dp, max_n_mbs):
                out.extend(Option(mesh, s, m, rc) for rc in recompute)
    return out


def call_placements(graph: DataflowGraph, call: str, max_n_mbs: int = MAX_N_MBS) -> list[CallPlacement]:
    return [CallPlacement.of(*o) for o in call_options(graph, call, max_n_mbs=max_n_mbs)]


def footprint(static: np.ndarray, dynamic: np.ndarray, param: np.ndarray) -> int:
    """Bytes the most loaded stage needs for the call alone (rule 1 of the module docstring).

    For a home call ``static`` holds at least the parameters; for any other call it is 0
    and the parameters count as a copy.
    """
    return int(np.maximum(static + dynamic, dynamic + param).max(initial=0))


def prune(costs: CallCosts, device_memory: int | None,
          keep: set = frozenset()) -> tuple[list[int], dict[str, int]]:
    """Rows of ``costs`` worth searching (rules in the module docstring), and how many each rule removed.

    Rows whose option is in ``keep`` (e.g. a baseline's placement) always stay; with
    ``device_memory=None`` rule 1 is off.
    """
    reasons = {"memory": 0, "dominated n_mbs": 0}
    fits = []
    for i, opt in enumerate(costs.options):
        own = footprint(costs.static[i], costs.dynamic[i], costs.param[i])
        if device_memory is None or own <= device_memory or opt in keep:
            fits.append(i)
        else:
            reasons["memory"] += 1
    groups: dict[tuple, list[int]] = {}
    for i in fits:
        c = costs.options[i]
        groups.setdefault((c.mesh, c.strategy, c.offload), []).append(i)  # one layout
    out = []
    for rows in groups.values():
        rows.sort(key=lambda i: (costs.time[i], costs.options[i].n_mbs, costs.options[i].recompute))
        kept: list[int] = []
        for i in rows:
            dominated = any(np.all(costs.dynamic[j] <= costs.dynamic[i]) for j in kept)
            if dominated and costs.options[i] not in keep:
                reasons["dominated n_mbs"] += 1
            else:
                kept.append(i)
        out.extend(kept)
    return sorted(out), reasons
