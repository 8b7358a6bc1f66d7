"""Who sends which bytes to whom when a model changes layout, or when data moves between calls.

This is the ONE pure planning function shared by the runtime (which executes the
plan with broadcasts, ``param_realloc.py``) and the estimator (which prices it).
No processes, no torch.

Parameters (realhf.txt §6 "Redistributing Parameters", Figure 7)::

    plan = plan_param_realloc(cfg, Layout(mesh1, ParallelStrategy(dp1, tp1, pp1)),
                              Layout(mesh2, ParallelStrategy(dp2, tp2, pp2)), bytes_per_element=2)
    plan.moved_bytes, plan.redundancy_ratio, plan.sent_bytes, plan.inter_node_bytes
    for t in plan.transfers: t.src, t.dsts, t.name, t.slices(shape), t.nbytes
    plan.local_copies   # pieces a destination copies from its own source shard (0 bytes moved)

Data (realhf.txt §6 "Data Transfer among Function Calls")::

    plan = plan_data_transfer({"seq": per_seq_bytes, "logp": ...},
                              DataLayout(mesh_a, strat_a, stages=(pp_a - 1,)),   # producer: last stage
                              DataLayout(mesh_b, strat_b, stages=(0,)))          # consumer: first stage

Algorithm. Both problems are "intervals of an axis, held by groups of equivalent
devices, needed by other devices". For parameters the axis is a tensor's TP split
dimension (``param_layout.ParamSpec.tp_dim``); a source TP chunk is held by every
dp replica of every pipeline stage that owns the layer. For data the axis is the
batch's sequence index; a producer dp rank's contiguous slice is held by all its tp
ranks on the producer stages -- the same picture with TP and DP swapped (§6).

A replicated KV-head shard (tp > KV heads, ``ParamSpec.tp_replicas``) is one source chunk
with more holders: the tp ranks that share it, on every dp replica and stage.

1. Outer loop over pipeline stage pairs: layers are grouped into *classes* that share
   (source stages, destination stages, shapes); every decoder block of a class has an
   identical plan, so each class is planned once and replicated (the cost is
   O(#classes x #params per layer x #devices), which keeps the estimator fast).
2. Inner loop: each destination first subtracts what it already holds (its own shard in
   the source layout, or cached data); the rest is cut into exact sub-intervals at every
   chunk boundary of both layouts, so when tp changes a destination receives exactly the
   parts of the source chunks it lacks -- nothing more.
3. For each (destination, source chunk) the source is chosen greedily: same node before
   another node (a device that holds the piece itself is step 2), then the least loaded
   equal-cost holder, which spreads destinations over dp replicas (or, for data, over tp
   ranks). Pieces that one source sends to several destinations become one broadcast.

Byte accounting (exact, per destination):
    minimal_bytes   = sum over destination devices of the bytes they need but do not hold.
    moved_bytes     = sum over transfers of nbytes * len(dsts): a broadcast to k destinations
                      counts k times, because k devices each receive the payload.
    redundancy_ratio = moved_bytes / minimal_bytes (1.0 when nothing needs to move).
    This planner never sends a byte twice to one device nor to a device that holds it, so
    the ratio is exactly 1.0; the tests check it against brute force.
    received_bytes[d] = bytes device d receives; sent_bytes[s] = payload delivered from s
    (nbytes * k, what its destinations receive); source_bytes[s] = payload counted once per
    broadcast (what a pipelined/tree broadcast injects). intra/inter_node_bytes split
    moved_bytes by whether source and destination share a node.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import defaultdict
from functools import cached_property, lru_cache
from types import MappingProxyType
from typing import Hashable, Iterable, Mapping, Sequence

from realloc.cluster import DeviceMesh
from realloc.graph.row_balance import row_runs
from realloc.models.config import ModelConfig, tp_error
from realloc.models.param_layout import ParamSpec, param_specs, stage_param_specs
from realloc.strategy import ParallelStrategy, even_ranges


# --------------------------------------------------------------------------- layouts
@dataclasses.dataclass(frozen=True)
class Layout:
    """A model's placement: a device mesh and a (dp, tp, pp) strategy over it."""

    mesh: DeviceMesh
    strategy: ParallelStrategy

    def __post_init__(self) -> None:
        if self.mesh.size != self.strategy.world_size:
            raise ValueError(f"layout {self.mesh.name} {self.strategy}: dp*tp*pp = {self.strategy.world_size} "
                             f"but the mesh has {self.mesh.size} devices; pick a strategy that fills the mesh")

    def device(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        """Global device id of a (dp, tp, pp) coordinate (mesh rank order: tp, then dp, then pp)."""
        return self._devices[dp_rank, tp_rank, pp_rank]

    @cached_property
    def _devices(self) -> Mapping[tuple[int, int, int], int]:
        return MappingProxyType({self.strategy.coords(r): d for r, d in enumerate(self.mesh.device_ids)})

    @cached_property
    def coords_by_device(self) -> Mapping[int, tuple[int, int, int]]:
        """Global device id -> (dp_rank, tp_rank, pp_rank)."""
        return MappingProxyType({d: self.strategy.coords(r) for r, d in enumerate(self.mesh.device_ids)})

    def __str__(self) -> str:
        return f"{self.mesh.name} {self.strategy}"


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """Which devices of a call's layout hold (producer) or need (consumer) its batch.

    Each dp rank owns a contiguous slice of the batch (``dp_ranges``), replicated on all of its
    tp ranks and on the pipeline ``stages`` listed. What ``realloc.models.engine.ParallelModel``
    returns fixes the producer side: ``forward()`` outputs (log-probs, values) sit on every tp
    rank of the last stage, ``stages=(pp - 1,)`` (or every stage with ``to_all_stages=True``);
    ``generate()`` outputs sit on every rank of the replica, ``stages=tuple(range(pp))``, which
    gives the planner more equal-cost sources. A consumer needs token inputs on its first
    stage, ``(0,)``, and loss inputs (rewards, advantages, old log-probs) on its last stage,
    ``(pp - 1,)``; list both when a call needs both kinds.
    """

    mesh: DeviceMesh
    strategy: ParallelStrategy
    stages: tuple[int, ...]
    # Each dp rank's [lo, hi) of the batch when they are not ``dp_ranges`` (token-balanced ranks,
    # ``row_balance.py``); None: the even split.
    ranges: tuple[tuple[int, int], ...] | None = None
    # Or each dp rank's rows as global sequence indices, in any pattern (issue 31: rows dealt by tokens);
    # the planner moves them as runs of consecutive rows (``row_balance.row_runs``).
    rows: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        Layout(self.mesh, self.strategy)  # validates the sizes
        for what, v in (("row ranges", self.ranges), ("row lists", self.rows)):
            if v is not None and len(v) != self.strategy.dp:
                raise ValueError(f"data layout {self.mesh.name} {self.strategy}: {len(v)} {what} for "
                                 f"{self.strategy.dp} dp ranks")
        if self.ranges is not None and self.rows is not None:
            raise ValueError(f"data layout {self.mesh.name} {self.strategy}: give row ranges or row lists, not both")
        if not self.stages or any(not 0 <= s < self.strategy.pp for s in self.stages):
            raise ValueError(f"data layout {self.mesh.name} {self.strategy}: stages {self.stages} must be a "
                             f"non-empty list of pipeline stages in 0..{self.strategy.pp - 1}")

    @property
    def layout(self) -> Layout:
        return Layout(self.mesh, self.strategy)

    def row_runs(self, n: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Each dp rank's rows of a batch of ``n`` sequences, as runs [lo, hi) of consecutive ones."""
        if self.rows is not None:
            return row_runs(self.rows, n, f"data layout {self.mesh.name} {self.strategy}")
        return tuple(((lo, hi),) if lo < hi else () for lo, hi in self.row_ranges(n))

    def row_ranges(self, n: int) -> tuple[tuple[int, int], ...]:
        """Each dp rank's [lo, hi) of a batch of ``n`` sequences (the runtime moves contiguous shares only)."""
        if self.rows is not None:
            runs = self.row_runs(n)
            if any(len(r) > 1 for r in runs):
                raise ValueError(f"data layout {self.mesh.name} {self.strategy}: its row lists are not contiguous")
            return tuple(r[0] if r else (0, 0) for r in runs)
        if self.ranges is None:
            return dp_ranges(n, self.strategy.dp)
        if self.ranges[0][0] != 0 or self.ranges[-1][1] != n or any(
                a[1] != b[0] or a[0] > a[1] for a, b in zip(self.ranges, self.ranges[1:])):
            raise ValueError(f"data layout {self.mesh.name} {self.strategy}: row ranges {self.ranges} do not tile "
                             f"the batch of {n} sequences")
        return self.ranges


def dp_ranges(n: int, dp: int) -> tuple[tuple[int, int], ...]:
    """Contiguous [lo, hi) share of n sequences per dp rank; earlier ranks take the remainder."""
    return even_ranges(n, dp)


def shard_intervals(cfg: ModelConfig, layout: Layout, device: int) -> dict[str, tuple[ParamSpec, int, int]]:
    """Parameters ``device`` holds in ``layout``: name -> (spec, lo, hi), its interval along
    ``spec.tp_dim`` in the full tensor ((0, 1) for a replicated tensor), as the planner uses them."""
    coords = layout.coords_by_device.get(device)
    if coords is None:
        return {}
    _, tp_rank, pp_rank = coords
    return {spec.name: (spec, *spec.shard_interval(layout.strategy.tp, tp_rank))
            for spec in stage_param_specs(cfg, layout.strategy.pp, pp_rank)}


# --------------------------------------------------------------------------- plan objects
@dataclasses.dataclass(frozen=True)
class Transfer:
    """``src`` sends interval [lo, hi) of ``name`` along ``axis`` to every device in ``dsts``.

    For a parameter, ``axis`` is its tp_dim (None: the whole, replicated tensor, lo=0, hi=1);
    for data, ``name`` is the key and [lo, hi) are sequence indices of the batch.
    """

    src: int
    dsts: tuple[int, ...]
    name: str
    axis: int | None
    lo: int
    hi: int
    nbytes: int

    def slices(self, shape: Sequence[int]) -> tuple[slice, ...]:
        """Index of the piece inside the full tensor of ``shape``."""
        return _interval_slices(shape, self.axis, self.lo, self.hi)


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """Device ``device`` already holds [lo, hi) of ``name``: copy it from its own source shard."""

    device: int
    name: str
    axis: int | None
    lo: int
    hi: int

    def slices(self, shape: Sequence[int]) -> tuple[slice, ...]:
        return _interval_slices(shape, self.axis, self.lo, self.hi)


def _interval_slices(shape: Sequence[int], axis: int | None, lo: int, hi: int) -> tuple[slice, ...]:
    if axis is None:
        return tuple(slice(None) for _ in shape)
    return tuple(slice(lo, hi) if d == axis else slice(None) for d in range(len(shape)))


@dataclasses.dataclass(frozen=True)
class _ClassPlan:
    """The plan of one class of identical layers: templates over item indices, replicated per member."""

    members: tuple[tuple[tuple[str, int | None], ...], ...]  # per member: (name, axis) of each item
    transfers: tuple[tuple[int, int, tuple[int, ...], int, int, int], ...]  # (item, src, dsts, lo, hi, nbytes)
    copies: tuple[tuple[int, int, int, int], ...]  # (item, device, lo, hi)


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """A complete, immutable plan. Statistics are exact; see the module docstring for the counting rules."""

    kind: str  # "param" or "data"
    classes: tuple[_ClassPlan, ...]
    minimal_bytes: int
    moved_bytes: int
    intra_node_bytes: int
    inter_node_bytes: int
    sent_bytes: Mapping[int, int]
    source_bytes: Mapping[int, int]
    received_bytes: Mapping[int, int]
    n_broadcasts: int
    # What the plan was made for, so an executor can locate each device's shards/slices.
    model: ModelConfig | None = None
    src: "Layout | DataLayout | None" = None
    dst: "Layout | DataLayout | None" = None
    seq_offsets: Mapping[str, tuple[int, ...]] | None = None  # data: key -> byte prefix sums per sequence
    bytes_per_element: int | None = None  # parameters: the element size the byte counts assume

    @property
    def redundancy_ratio(self) -> float:
        return 1.0 if self.minimal_bytes == 0 else self.moved_bytes / self.minimal_bytes

    @property
    def empty(self) -> bool:
        return self.n_broadcasts == 0

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, in a deterministic order (layer order, then parameter order, then interval)."""
        out = []
        for c in self.classes:
            for member in c.members:
                for item, src, dsts, lo, hi, nbytes in c.transfers:
                    name, axis = member[item]
                    out.append(Transfer(src, dsts, name, axis, lo, hi, nbytes))
        return tuple(out)

    @cached_property
    def local_copies(self) -> tuple[LocalCopy, ...]:
        out = []
        for c in self.classes:
            for member in c.members:
                for item, dev, lo, hi in c.copies:
                    name, axis = member[item]
                    out.append(LocalCopy(dev, name, axis, lo, hi))
        return tuple(out)

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Distinct (src, *dsts) device groups with 2+ destinations, sorted: the process groups a
        broadcast-based executor must create, in the same order on every worker."""
        return tuple(sorted({(t.src, *t.dsts) for t in self.transfers if len(t.dsts) > 1}))

    def max_device_bytes(self) -> int:
        """The most bytes any single device sends (payload once per broadcast) or receives."""
        return max([0, *self.source_bytes.values(), *self.received_bytes.values()])

    def summary(self) -> str:
        dev = sorted(set(self.sent_bytes) | set(self.received_bytes))
        rows = [f"{self.kind} plan: {self.n_broadcasts} transfers, moved {self.moved_bytes:,} B "
                f"(minimal {self.minimal_bytes:,} B, redundancy {self.redundancy_ratio:.3f}), "
                f"intra-node {self.intra_node_bytes:,} B, inter-node {self.inter_node_bytes:,} B"]
        rows += [f"  device {d}: sends {self.sent_bytes.get(d, 0):,} B, receives {self.received_bytes.get(d, 0):,} B"
                 for d in dev]
        return "\n".join(rows)


# --------------------------------------------------------------------------- the core
@dataclasses.dataclass(frozen=True)
class _Item:
    """One tensor (or data key) of a class, split along one integer axis [0, extent)."""

    extent: int
    stride: int  # bytes per axis position, when offsets is None
    offsets: tuple[int, ...] | None  # prefix sums of bytes per position (data: per-sequence sizes)
    groups: tuple[tuple[int, int, tuple[int, ...], Hashable], ...]  # (lo, hi, holder devices, decision key)
    needs: tuple[tuple[int, int, int], ...]  # (device, lo, hi)
    held: Mapping[int, tuple[tuple[int, int], ...]]  # device -> intervals it already holds

    def nbytes(self, lo: int, hi: int) -> int:
        if self.offsets is None:
            return (hi - lo) * self.stride
        return self.offsets[hi] - self.offsets[lo]


def _subtract(lo: int, hi: int, held: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) minus the union of ``held``, as sorted disjoint intervals."""
    out, cur = [], lo
    for a, b in sorted(held):
        if b <= cur or a >= hi:
            continue
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < hi:
        out.append((cur, hi))
    return out


@dataclasses.dataclass
class _Totals:
    """Mutable accumulator used only while one plan is being built."""

    node_of: dict[int, object]  # device -> its node (any value that compares equal on one node)
    load: defaultdict = dataclasses.field(default_factory=lambda: defaultdict(int))
    sent: defaultdict = dataclasses.field(default_factory=lambda: defaultdict(int))
    source: defaultdict = dataclasses.field(default_factory=lambda: defaultdict(int))
    received: defaultdict = dataclasses.field(default_factory=lambda: defaultdict(int))
    minimal: int = 0
    moved: int = 0
    intra: int = 0
    inter: int = 0
    n_broadcasts: int = 0


def _plan_class(items: Sequence[_Item], mult: int, tot: _Totals) -> tuple[tuple, tuple]:
    """Plan one class of identical layers (or the whole batch for data); add stats x ``mult``."""
    # Pass 1: each destination's missing atoms, attributed to the holder group that owns them.
    # Atoms are cut at every boundary of every interval of the item, so two destinations that
    # lack the same bytes see the same atoms and can share one broadcast.
    copies: list[tuple[int, int, int, int]] = []
    wants: list[list[tuple[int, int, int, int]]] = []  # per item: (dest, group index, lo, hi)
    demand: dict[tuple[int, Hashable], int] = defaultdict(int)  # (dest, decision key) -> bytes
    for idx, it in enumerate(items):
        cuts = {0, it.extent}
        for lo, hi, _, _ in it.groups:
            cuts.update((lo, hi))
        for _, lo, hi in it.needs:
            cuts.update((lo, hi))
        for ivs in it.held.values():
            for lo, hi in ivs:
                cuts.update((lo, hi))
        grid = sorted(cuts)
        # The holder group of every grid cell (groups are disjoint and every cell lies in one).
        cell_group: list[int] = []
        for x, y in zip(grid, grid[1:]):
            cell_group.append(next(i for i, (glo, ghi, _, _) in enumerate(it.groups) if glo <= x and y <= ghi))
        cell_bytes = [it.nbytes(x, y) for x, y in zip(grid, grid[1:])]
        mine = []
        for dev, lo, hi in it.needs:
            held = it.held.get(dev, ())
            for a, b in held:
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    copies.append((idx, dev, a, b))
            for a, b in _subtract(lo, hi, held):
                for k in range(bisect_left(grid, a), bisect_left(grid, b)):
                    g, nb = cell_group[k], cell_bytes[k]
                    mine.append((dev, g, grid[k], grid[k + 1]))
                    demand[dev, it.groups[g][3]] += nb
                    tot.minimal += nb * mult
        wants.append(mine)

    # Pass 2: pick a source per (destination, decision key), biggest demand first, so that load
    # balancing sees the heavy shards before the small replicated ones.
    holders: dict[Hashable, tuple[int, ...]] = {}
    for it in items:
        for _, _, devs, key in it.groups:
            holders.setdefault(key, devs)
    choice: dict[tuple[int, Hashable], int] = {}
    chosen_by_dest: dict[int, set[int]] = defaultdict(set)
    for (dev, key), nb in sorted(demand.items(), key=lambda kv: (-kv[1], kv[0][0], repr(kv[0][1]))):
        def score(s: int) -> tuple:
            remote = tot.node_of[s] != tot.node_of[dev]
            return (remote, s not in chosen_by_dest[dev], tot.load[s], s)
        src = min(holders[key], key=score)
        assert src != dev, "a device never receives what it holds"
        choice[dev, key] = src
        chosen_by_dest[dev].add(src)
        tot.load[src] += nb * mult

    # Pass 3: one broadcast per (item, atom, source) with all its destinations, then merge
    # neighbouring atoms that go from the same source to the same destinations.
    transfers = []
    for idx, (it, mine) in enumerate(zip(items, wants)):
        by_atom: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for dev, g, x, y in mine:
            by_atom[x, y, choice[dev, it.groups[g][3]]].append(dev)
        merged: list[list] = []
        for src, dsts_t, x, y in sorted((src, tuple(sorted(d)), x, y) for (x, y, src), d in by_atom.items()):
            last = merged[-1] if merged else None
            if last and last[0] == src and last[1] == dsts_t and last[3] == x:
                last[3] = y
            else:
                merged.append([src, dsts_t, x, y])
        for src, dsts_t, x, y in sorted(merged, key=lambda m: (m[2], m[0], m[1])):
            nb = it.nbytes(x, y)
            transfers.append((idx, src, dsts_t, x, y, nb))
            tot.n_broadcasts += mult
            tot.source[src] += nb * mult
            for d in dsts_t:
                tot.sent[src] += nb * mult
                tot.received[d] += nb * mult
                tot.moved += nb * mult
                if tot.node_of[src] == tot.node_of[d]:
                    tot.intra += nb * mult
                else:
                    tot.inter += nb * mult
    return tuple(transfers), tuple(copies)


def _finish(kind: str, classes: list[_ClassPlan], tot: _Totals, **made_for) -> TransferPlan:
    assert tot.moved == tot.intra + tot.inter
    return TransferPlan(kind=kind, classes=tuple(classes), minimal_bytes=tot.minimal, moved_bytes=tot.moved,
                        intra_node_bytes=tot.intra, inter_node_bytes=tot.inter,
                        sent_bytes=MappingProxyType(dict(tot.sent)), source_bytes=MappingProxyType(dict(tot.source)),
                        received_bytes=MappingProxyType(dict(tot.received)), n_broadcasts=tot.n_broadcasts,
                        **made_for)


def _node_map(devices_per_node: int | None, *meshes: DeviceMesh) -> dict[int, object]:
    per_node = {m.devices_per_node for m in meshes}
    if devices_per_node is None:
        if len(per_node) != 1:  # pools of different node sizes: a node is (its pool's first device, index in pool)
            return {d: (m.device_offset, (d - m.device_offset) // m.devices_per_node)
                    for m in meshes for d in m.device_ids}
        devices_per_node = per_node.pop()
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be positive, got {devices_per_node}")
    return {d: d // devices_per_node for m in meshes for d in m.device_ids}


# --------------------------------------------------------------------------- parameters
def _check_layout(cfg: ModelConfig, lay: Layout, which: str) -> None:
    s = lay.strategy
    if s.pp > cfg.n_layers:
        raise ValueError(f"{which} layout {lay}: pp={s.pp} exceeds the {cfg.n_layers} layers of {cfg.name}")
    err = tp_error(cfg, s.tp)
    if err:
        raise ValueError(f"{which} layout {lay}: {err}; choose another tp")


def _stages_holding(cfg: ModelConfig, pp: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, list[int]] = defaultdict(list)
    for stage in range(pp):
        for spec in stage_param_specs(cfg, pp, stage):
            out[spec.name].append(stage)
    return {k: tuple(v) for k, v in out.items()}


def _param_item(spec: ParamSpec, src: Layout, dst: Layout, src_stages: tuple[int, ...],
                dst_stages: tuple[int, ...], bpe: int) -> _Item:
    s1, s2 = src.strategy, dst.strategy
    # A tensor without tp_dim is one interval [0, 1) of all its bytes; a split one is cut along tp_dim.
    extent = 1 if spec.tp_dim is None else spec.shape[spec.tp_dim]
    stride = spec.numel // extent * bpe
    # One holder group per distinct source shard: every dp replica and stage holding the layer, and
    # every tp rank holding that shard (one rank, all ranks for an unsplit tensor, or the ranks that
    # share a replicated KV head).
    rep = spec.tp_replicas(s1.tp)
    groups = []
    for first in range(0, s1.tp, rep):
        ranks = range(first, first + rep)
        devs = tuple(src.device(dp, t, st) for st in src_stages for dp in range(s1.dp) for t in ranks)
        # The decision key names the holder set; items of a class that share it take one source.
        key = (src_stages, None if spec.tp_dim is None else first if rep == 1 else tuple(ranks))
        groups.append((*spec.shard_interval(s1.tp, first), devs, key))
    needs = tuple((dst.device(dp, t, st), *spec.shard_interval(s2.tp, t)) for st in dst_stages
                  for dp in range(s2.dp) for t in range(s2.tp))
    held = {}
    for dev, _, _ in needs:
        c = src.coords_by_device.get(dev)
        if c is not None and c[2] in src_stages:
            held[dev] = (spec.shard_interval(s1.tp, c[1]),)
    return _Item(extent, stride, None, tuple(groups), needs, held)


@lru_cache(maxsize=512)
def plan_param_realloc(cfg: ModelConfig, src: Layout, dst: Layout, *, bytes_per_element: int = 4,
                       devices_per_node: int | None = None) -> TransferPlan:
    """Plan moving every parameter of ``cfg`` from layout ``src`` to layout ``dst`` (realhf.txt §6).

    ``devices_per_node`` defaults to the meshes' own; devices on one node are cheaper sources.
    Shards, names and stage assignment come from ``realloc.models.param_layout``. Cached:
    all inputs are frozen and the plan is immutable.
    """
    if bytes_per_element < 1:
        raise ValueError(f"bytes_per_element must be positive, got {bytes_per_element}")
    _check_layout(cfg, src, "source")
    _check_layout(cfg, dst, "destination")
    tot = _Totals(_node_map(devices_per_node, src.mesh, dst.mesh))
    src_st, dst_st = _stages_holding(cfg, src.strategy.pp), _stages_holding(cfg, dst.strategy.pp)
    # Outer loop (Figure 7 left): layers whose parameters live on the same (source stages,
    # destination stages) pairs and have the same shapes form one class, planned once.
    by_layer: dict[int, list[ParamSpec]] = defaultdict(list)
    for spec in param_specs(cfg):
        by_layer[spec.layer].append(spec)
    classes: dict[tuple, list[int]] = {}
    for layer, specs in by_layer.items():
        key = tuple((spec.shape, spec.tp_dim, spec.tp_units, src_st[spec.name], dst_st[spec.name]) for spec in specs)
        classes.setdefault(key, []).append(layer)
    out = []
    for key, layers in classes.items():
        rep = by_layer[layers[0]]
        items = [_param_item(spec, src, dst, src_st[spec.name], dst_st[spec.name], bytes_per_element)
                 for spec in rep]
        transfers, copies = _plan_class(items, len(layers), tot)
        members = tuple(tuple((spec.name, spec.tp_dim) for spec in by_layer[layer]) for layer in layers)
        out.append(_ClassPlan(members, transfers, copies))
    return _finish("param", out, tot, model=cfg, src=src, dst=dst, bytes_per_element=bytes_per_element)


# --------------------------------------------------------------------------- data
def plan_data_transfer(seq_bytes: Mapping[str, Sequence[int]], producer: DataLayout, consumer: DataLayout, *,
                       cached: Mapping[int, Sequence[tuple[str, int, int]]] | None = None,
                       devices_per_node: int | None = None) -> TransferPlan:
    """Plan moving a batch's keys from the devices that produced them to those that consume them.

    ``seq_bytes[key][i]`` is the size in bytes of sequence i of ``key`` (use
    ``[nbytes] * n`` for fixed-size rows). Producer dp rank k holds its rows (``producer.row_runs(n)[k]``: the
    even split ``dp_ranges``, or the layout's ranges or row lists) on all its tp ranks and ``producer.stages``;
    each device of consumer dp rank c on ``consumer.stages`` needs ``consumer.row_runs(n)[c]``.
    ``cached[device]`` lists (key, lo, hi) sequence ranges a device already holds from an
    earlier transfer (the paper's local data cache); they are never sent again to it.
    """
    tot = _Totals(_node_map(devices_per_node, producer.mesh, consumer.mesh))
    pl, cl = producer.layout, consumer.layout
    ps, cs = producer.strategy, consumer.strategy
    cached = cached or {}
    items, members, all_offsets = [], [], {}
    for key in sorted(seq_bytes):  # every process must derive the same transfer order
        sizes = seq_bytes[key]
        if any(int(b) < 0 for b in sizes):
            raise ValueError(f"data key {key!r}: sequence sizes must be non-negative byte counts")
        n = len(sizes)
        offsets = [0]
        for b in sizes:
            offsets.append(offsets[-1] + int(b))
        all_offsets[key] = tuple(offsets)
        groups, needs = [], []
        p_runs = producer.row_runs(n)
        for k, runs in enumerate(p_runs):
            devs = tuple(pl.device(k, t, st) for st in producer.stages for t in range(ps.tp))
            groups.extend((lo, hi, devs, k) for lo, hi in runs)
        for c, runs in enumerate(consumer.row_runs(n)):
            for lo, hi in runs:
                needs.extend((cl.device(c, t, st), lo, hi) for st in consumer.stages for t in range(cs.tp))
        held: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for dev in dict.fromkeys(dev for dev, _, _ in needs):  # a device may need several runs
            coords = pl.coords_by_device.get(dev)
            if coords is not None and coords[2] in producer.stages:
                held[dev].extend(p_runs[coords[0]])
            for ck, lo, hi in cached.get(dev, ()):
                if ck == key:
                    if not 0 <= lo <= hi <= n:
                        raise ValueError(f"cached range ({key!r}, {lo}, {hi}) on device {dev} is outside the "
                                         f"batch of {n} sequences")
                    held[dev].append((lo, hi))
        items.append(_Item(n, 0, tuple(offsets), tuple(g for g in groups if g[0] < g[1]), tuple(needs),
                           {d: tuple(v) for d, v in held.items()}))
        members.append((key, 0))
    transfers, copies = _plan_class(items, 1, tot)
    return _finish("data", [_ClassPlan((tuple(members),), transfers, copies)], tot, src=producer, dst=consumer,
                   seq_offsets=MappingProxyType(all_offsets))
