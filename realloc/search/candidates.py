"""Candidate placements of one call: every (mesh, strategy, n_mbs) the cluster allows."""

from __future__ import annotations

from realloc.cluster import ClusterSpec, DeviceMesh
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import CallPlacement
from realloc.strategy import ParallelStrategy, enumerate_strategies, micro_batch_options

# realhf.txt Table 4 uses up to 16 micro-batches; 64 leaves room for deep pipelines.
MAX_N_MBS = 64


def call_options(graph: DataflowGraph, call: str, cluster: ClusterSpec | None = None,
                 max_n_mbs: int = MAX_N_MBS) -> list[tuple[DeviceMesh, ParallelStrategy, int]]:
    """All placements of ``call`` before any memory pruning."""
    cluster = cluster or graph.spec.cluster
    cfg = graph.model_config(call)
    n_seqs = graph.steps_n_seqs(call)
    out = []
    for mesh in cluster.device_meshes():
        if cfg is None:
            # A rule function runs once per dp rank, with no model to shard.
            strategies = [ParallelStrategy(mesh.size, 1, 1)] if n_seqs % mesh.size == 0 else []
        else:
            strategies = list(enumerate_strategies(cfg, mesh.size, mesh.n_devs, n_seqs))
        for s in strategies:
            for m in micro_batch_options(n_seqs, s.dp, max_n_mbs):
                out.append((mesh, s, m))
    return out


def call_placements(graph: DataflowGraph, call: str, max_n_mbs: int = MAX_N_MBS) -> list[CallPlacement]:
    return [CallPlacement.of(mesh, s, m) for mesh, s, m in call_options(graph, call, max_n_mbs=max_n_mbs)]
