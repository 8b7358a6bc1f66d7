"""Messages between the pools of a heterogeneous cluster (docs/heterogeneous.md).

A transfer plan (``graph/transfer_plan.py``) between layouts on two pools sends each piece from a device of
one pool to devices of the other. Inside one pool a message costs what the pool's own ``CommModel`` says
(its intra- or inter-node link); a message with a destination in another pool crosses the pool link:
``latency + bytes / bandwidth``, one hop (a broadcast over the pool link is pipelined, bus factor 1,
``comm.bus_factor``). The devices' NICs are shared by nothing else during a transfer, so messages that
share no device overlap as in ``transfer_cost.plan_seconds``.

The sender sends its own dtype and the receiver casts on receive (the cast loading the checkpoint in the
receiver's dtype makes), so the bytes on the wire are the source pool's bytes per element.
"""

from __future__ import annotations

from typing import Sequence

from realloc.cluster import ClusterSpec
from realloc.estimator.comm import CommModel, Link
from realloc.estimator.transfer_cost import plan_seconds
from realloc.graph.transfer_plan import TransferPlan


def pooled_plan_seconds(plan: TransferPlan, cluster: ClusterSpec, comms: Sequence[CommModel]) -> float:
    """Wall time of ``plan`` on a cluster of pools (global device ids; ``comms[i]`` is pool i's links)."""
    offsets = cluster.pool_offsets

    def where(device: int) -> tuple[int, int]:
        pool = cluster.pool_of_device(device)
        return pool, (device - offsets[pool]) // cluster.pools[pool].n_devices_per_node

    def message_time(op: str, src: int, dsts: tuple[int, ...], nbytes: float) -> float:
        pool, node = where(src)
        places = [where(d) for d in dsts]
        if any(p != pool for p, _ in places):
            return cluster.pool_link_latency + nbytes / cluster.pool_link_bandwidth
        link = Link.INTER if any(n != node for _, n in places) else Link.INTRA
        return comms[pool].time(op, len(dsts) + 1, nbytes, link)

    return plan_seconds(plan, comms[0], 0, message_time)
