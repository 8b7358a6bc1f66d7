"""Collective communication time: alpha + beta * bytes per collective, group size and link kind.

Two sources, one formula:
- measured fits from a profile table (``realloc profile`` fits alpha and beta for
  broadcast, all-reduce, all-gather and p2p among N processes), used when the
  profile was made on the cluster's device kind;
- otherwise the analytic ring model over the ClusterSpec's bandwidths: a ring
  all-reduce moves 2(n-1)/n x bytes per rank, an all-gather (n-1) x bytes (its
  input), a reduce-scatter (n-1)/n x bytes (its input), a broadcast or a p2p send
  the message once. A ring all-reduce is a reduce-scatter then an all-gather, so
  sequence parallelism's pair moves the bytes of the all-reduce it replaces. No
  profile measures reduce-scatter: it is timed as the all-gather of its output,
  which moves the same bytes on a ring. Bandwidths and latencies
  never come from constants in this file.

A group "crosses nodes" when its members sit on more than one node; a ring is then
limited by the inter-node link (realhf.txt section 4: two bandwidth types).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterable, Mapping

from realloc.cluster import ClusterSpec
from realloc.strategy import ParallelStrategy

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


class Link(str, enum.Enum):
    INTRA = "intra"
    INTER = "inter"


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank puts on its link per byte of the collective's input (ring algorithms)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op == "all_gather":
        return float(n - 1)
    if op == "reduce_scatter":
        return (n - 1) / n
    if op in ("broadcast", "p2p"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


@dataclasses.dataclass(frozen=True)
class CollectiveFit:
    """Measured ``time = alpha + beta * nbytes`` of ``op`` among ``n`` processes over ``link``."""

    op: str
    n: int
    link: Link
    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


class CommModel:
    """Times collectives of a cluster, from measured fits when available, else from its bandwidths."""

    def __init__(self, cluster: ClusterSpec, fits: Iterable[CollectiveFit] = ()) -> None:
        hw = cluster.hardware
        eff = hw.comm_efficiency
        self._bandwidth = {Link.INTRA: cluster.intra_node_bandwidth * eff, Link.INTER: cluster.inter_node_bandwidth * eff}
        self._latency = {Link.INTRA: hw.intra_node_latency, Link.INTER: hw.inter_node_latency}
        by_key: dict[tuple[str, Link], dict[int, CollectiveFit]] = {}
        for f in fits:
            by_key.setdefault((f.op, Link(f.link)), {})[f.n] = f
        self._fits: Mapping[tuple[str, Link], Mapping[int, CollectiveFit]] = by_key
        self._uniform_links = cluster.intra_node_bandwidth == cluster.inter_node_bandwidth

    @property
    def measured(self) -> bool:
        return bool(self._fits)

    def bandwidth(self, link: Link) -> float:
        """Achieved point-to-point bytes/s of one device over ``link``."""
        return self._bandwidth[link]

    def time(self, op: str, n: int, nbytes: float, link: Link = Link.INTRA) -> float:
        """Seconds for one ``op`` among ``n`` ranks on ``nbytes`` of input per rank."""
        if n <= 1 or nbytes < 0:
            return 0.0
        if op == "reduce_scatter" and self._fits:
            return self.time("all_gather", n, nbytes / n, link)
        fits = self._fits.get((op, link))
        if fits is None and self._uniform_links:
            # one kind of link (e.g. local processes as "nodes"): the other measurement applies
            fits = self._fits.get((op, Link.INTRA if link is Link.INTER else Link.INTER))
        if fits:
            if n in fits:
                return fits[n].time(nbytes)
            # nearest measured group size, rescaled by the ring's bytes-on-the-wire factor
            ref = fits[min(fits, key=lambda k: (abs(k - n), -k))]
            return ref.alpha + ref.beta * nbytes * bus_factor(op, n) / bus_factor(op, ref.n)
        return self._latency[link] + bus_factor(op, n) * nbytes / self._bandwidth[link]

    def late_extra(self, n: int, link: Link = Link.INTRA) -> float:
        """Seconds a blocking collective among ``n`` ranks adds when they enter it at different times, beyond the
        latency ``time`` gives it: the measured ``all_reduce_late`` (the nearest measured group size) less the
        all-reduce's own time at its 8 bytes, never below 0. 0 where not measured (the roofline, tables from before
        the key), so those price as before. docs/estimator.md, "Waits at dp > 1"."""
        fits = self._fits.get(("all_reduce_late", link))
        if fits is None and self._uniform_links:
            fits = self._fits.get(("all_reduce_late", Link.INTRA if link is Link.INTER else Link.INTER))
        if n <= 1 or not fits:
            return 0.0
        late = fits[n] if n in fits else fits[min(fits, key=lambda k: (abs(k - n), -k))]
        return max(0.0, late.time(8) - self.time("all_reduce", n, 8, link))


# -- which link each parallel group uses ------------------------------------

@dataclasses.dataclass(frozen=True)
class GroupLinks:
    tp: Link
    dp: Link
    pp: tuple[Link, ...]  # link between pipeline stage s and s+1
    world: Link  # a collective over every rank of the layout

    @property
    def pp_any(self) -> Link:
        """The link of a collective over a whole pipeline group."""
        return Link.INTER if Link.INTER in self.pp else Link.INTRA


def _crosses(ranks: Iterable[int], devs_per_node: int) -> Link:
    return Link.INTER if len({r // devs_per_node for r in ranks}) > 1 else Link.INTRA


def group_links(mesh_shape: tuple[int, int], strategy: ParallelStrategy) -> GroupLinks:
    """Link kinds of the tp, dp and pp groups of ``strategy`` on a mesh of shape (nodes, devices per node).

    Mesh-local ranks are node-major (``DeviceMesh.device_ids``) and the strategy
    orders them tp fastest, then dp, then pp (``ParallelStrategy.rank``). All
    groups of one kind are translates of each other, so checking group 0 is
    enough for tp and dp; pipeline boundaries are checked one by one, taking the
    worst tp/dp position of each.
    """
    n_nodes, m = mesh_shape
    s = strategy
    tp = _crosses((s.rank(0, i, 0) for i in range(s.tp)), m)
    dp = Link.INTRA
    for pp_rank in range(s.pp):
        for tp_rank in range(s.tp):
            if _crosses((s.rank(d, tp_rank, pp_rank) for d in range(s.dp)), m) is Link.INTER:
                dp = Link.INTER
    pp = []
    for stage in range(s.pp - 1):
        link = Link.INTRA
        for d in range(s.dp):
            for t in range(s.tp):
                if _crosses((s.rank(d, t, stage), s.rank(d, t, stage + 1)), m) is Link.INTER:
                    link = Link.INTER
        pp.append(link)
    world = Link.INTER if n_nodes > 1 else Link.INTRA
    return GroupLinks(tp=tp, dp=dp, pp=tuple(pp), world=world)
