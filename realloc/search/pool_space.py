"""The search on a heterogeneous cluster (docs/heterogeneous.md): the problem's pool fields, and each pool
alone as a cluster of its own (to compare the searched plan with the best plan on the strongest pool)."""

from __future__ import annotations

import dataclasses

from realloc.api import ExperimentSpec
from realloc.cluster import ClusterSpec
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import ExecutionPlan


def pool_fields(cluster: ClusterSpec) -> dict:
    """``SearchProblem`` fields of the cluster's hosts and pools: cores shared per host, each pool's memory."""
    if not cluster.pools:
        return dict(devices_per_node=cluster.n_devices_per_node,
                    cores_per_node=cluster.cores_per_device * cluster.n_devices_per_node)
    fields = dict(pool_start=cluster.pool_offsets, pool_memory=tuple(p.device_memory for p in cluster.pools))
    if all(p.cores_per_device >= 1 for p in cluster.pools):
        return dict(fields, devices_per_node=0, cores_per_node=0.0)  # every device has a core of its own
    hosts = {(p.n_devices_per_node, p.cores_per_device) for p in cluster.pools}
    if len(hosts) > 1:
        raise ValueError(f"cluster {cluster.nodelist!r}: pools whose devices share CPU cores must have the same "
                         f"devices per node and cores per device (the planner models one host size)")
    n, cores = hosts.pop()
    return dict(fields, devices_per_node=n, cores_per_node=cores * n)


def pool_label(cluster: ClusterSpec, pool: int) -> str:
    """``0:a100-80g``: a pool as the search's report names it."""
    return f"{pool}:{cluster.pool_cluster(pool).device}"


def strongest_pool(cluster: ClusterSpec) -> int:
    """The pool with the most dense FLOP/s in all (devices x peak of its kind)."""
    pools = cluster.pools or (cluster,)
    return max(range(len(pools)), key=lambda i: pools[i].n_devices * pools[i].hardware.peak_flops)


def pool_alone(spec: ExperimentSpec, pool: int) -> ExperimentSpec:
    """The experiment on one pool of its cluster only (its mesh names are the same as on the whole)."""
    return dataclasses.replace(spec, cluster=spec.cluster.pool_cluster(pool))


def on_cluster(plan: ExecutionPlan, graph: DataflowGraph) -> ExecutionPlan:
    """A plan of one pool alone as a plan of the whole cluster of ``graph`` (the same meshes; the other pools
    idle). Its estimates carry over: a pool's model prices the calls and transfers inside the pool as the pool
    alone does (``CostModel.at``)."""
    cluster = graph.spec.cluster
    return plan.model_copy(update=dict(experiment=graph.spec.name, graph_digest=graph.digest,
                                       nodelist=cluster.nodelist, n_devices_per_node=cluster.n_devices_per_node,
                                       device=cluster.device))
