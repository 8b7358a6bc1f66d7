"""The cluster: SLURM-style nodelists, hardware defaults, and device meshes.

A device mesh (realhf.txt section 4) either spans whole consecutive nodes or
is an aligned block of 1, 2, 4, ... devices inside one node, so that meshes can
tile the cluster without idle devices.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from functools import cached_property
from typing import Any, Mapping, Sequence

from realloc.estimator.hardware import HardwareSpec, load_hardware_spec

# The GPU a worker uses when its launcher says (the local launcher: GPU r for rank r, every pool on this machine);
# otherwise the worker's index inside its pool's node (``ClusterSpec.local_device``). Here, not beside the worker's
# code, so that the launcher (in the torch-free master) can name it.
LOCAL_DEVICE_ENV = "REALLOC_LOCAL_DEVICE"

_NODE_CHARS = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"nodelist {text!r}: unmatched ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"nodelist {text!r}: unmatched '['")
    parts.append("".join(cur))
    return parts


def _expand_range_list(body: str, whole: str) -> list[str]:
    out = []
    for piece in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not m:
            raise ValueError(f"nodelist {whole!r}: bad range {piece!r} (expected N or N-M, e.g. com[01-08])")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"nodelist {whole!r}: range {piece!r} runs backwards")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def parse_nodelist(nodelist: str) -> tuple[str, ...]:
    """Expand a SLURM-style nodelist: ``com[01-08]``, ``node[1-3,5]``, ``a,b``, ``localhost``."""
    text = nodelist.strip()
    if not text:
        raise ValueError("nodelist is empty; give e.g. 'localhost' or 'com[01-08]'")
    nodes: list[str] = []
    for item in _split_top_level(text):
        item = item.strip()
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range_list(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p]
        for combo in itertools.product(*choices):
            name = "".join(combo)
            if not _NODE_CHARS.match(name):
                raise ValueError(f"nodelist {nodelist!r}: bad node name {name!r}")
            nodes.append(name)
    if len(set(nodes)) != len(nodes):
        dup = next(n for n in nodes if nodes.count(n) > 1)
        raise ValueError(f"nodelist {nodelist!r} names node {dup!r} twice")
    return tuple(nodes)


def compress_nodelist(nodes: tuple[str, ...] | list[str]) -> str:
    """Inverse of parse_nodelist for a run of nodes: ``com01, com02`` -> ``com[01-02]``."""
    if len(nodes) == 1:
        return nodes[0]
    parsed = [re.fullmatch(r"(.*?)(\d+)", n) for n in nodes]
    if all(parsed):
        prefixes = {m.group(1) for m in parsed}
        widths = {len(m.group(2)) for m in parsed}
        nums = [int(m.group(2)) for m in parsed]
        if len(prefixes) == 1 and len(widths) == 1 and nums == list(range(nums[0], nums[0] + len(nums))):
            w = widths.pop()
            return f"{prefixes.pop()}[{str(nums[0]).zfill(w)}-{str(nums[-1]).zfill(w)}]"
    return ",".join(nodes)


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """A block of devices: ``n_devs`` devices from ``dev_start`` on each of ``nodes``.

    Global device ids are ``node_index * devices_per_node + local_index``.
    """

    nodes: tuple[str, ...]
    first_node: int
    dev_start: int
    n_devs: int
    devices_per_node: int
    # A cluster of several pools (heterogeneous kinds): the pool the mesh lies in and the pool's first global
    # device id; ``first_node`` counts inside the pool. One-pool clusters keep 0 and 0.
    device_offset: int = 0
    pool: int = 0

    def __post_init__(self) -> None:
        assert self.nodes and 0 <= self.dev_start and self.dev_start + self.n_devs <= self.devices_per_node
        assert len(self.nodes) == 1 or (self.dev_start == 0 and self.n_devs == self.devices_per_node)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def size(self) -> int:
        return self.n_nodes * self.n_devs

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_nodes, self.n_devs)

    @cached_property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(self.device_offset + (self.first_node + i) * self.devices_per_node + self.dev_start + j
                     for i in range(self.n_nodes) for j in range(self.n_devs))

    @property
    def in_pool(self) -> "DeviceMesh":
        """The same mesh numbered inside its pool (device ids from 0), as the pool's own cluster sees it."""
        return dataclasses.replace(self, device_offset=0, pool=0) if self.device_offset or self.pool else self

    def overlaps(self, other: "DeviceMesh") -> bool:
        return not set(self.device_ids).isdisjoint(other.device_ids)

    def contains(self, other: "DeviceMesh") -> bool:
        return set(other.device_ids) <= set(self.device_ids)

    @property
    def whole_nodes(self) -> bool:
        return self.n_devs == self.devices_per_node

    @property
    def name(self) -> str:
        if self.whole_nodes:
            return compress_nodelist(self.nodes)
        last = self.dev_start + self.n_devs - 1
        span = str(self.dev_start) if self.n_devs == 1 else f"{self.dev_start}-{last}"
        return f"{self.nodes[0]}:{span}"

    def __str__(self) -> str:
        return self.name


def _check_devices_per_node(n: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n & (n - 1):
        raise ValueError(f"n_devices_per_node must be a power of two (1, 2, 4, 8, ...), got {n!r}")
    return n


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Nodes, devices per node, and the hardware numbers the estimator uses."""

    nodelist: str
    n_devices_per_node: int
    device: str
    device_memory: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    # CPU cores each device can count on; below 1 the node's devices share cores, and calls that run
    # at the same time on its devices slow each other down (the planner's simulator models it).
    cores_per_device: float
    nodes: tuple[str, ...] = ()
    # The dtype the devices compute in when not the kind's own (HardwareSpec.dtypes lists the choices).
    dtype: str | None = None
    # A heterogeneous cluster (``from_pools``): its pools, each a one-kind ClusterSpec, in global device id
    # order, and the link between pools. Empty for one kind: the fields above are then the whole story.
    # With pools, the fields above summarize them (nodelist and device joined, the largest device memory
    # and devices per node, the smallest bandwidths and cores); code that prices or places asks the pool.
    pools: tuple["ClusterSpec", ...] = ()
    pool_link_bandwidth: float = 0.0  # bytes/s per device, one direction, between devices of two pools
    pool_link_latency: float = 0.0  # seconds per message between pools

    def __post_init__(self) -> None:
        if not self.nodes:
            object.__setattr__(self, "nodes", parse_nodelist(self.nodelist))
        _check_devices_per_node(self.n_devices_per_node)
        for field in ("device_memory", "intra_node_bandwidth", "inter_node_bandwidth", "cores_per_device"):
            if getattr(self, field) <= 0:
                raise ValueError(f"cluster {self.nodelist!r}: {field} must be positive")

    @classmethod
    def from_nodelist(cls, nodelist: str, n_devices_per_node: int | None = None, device: str = "cpu",
                      dtype: str | None = None, **overrides: float) -> "ClusterSpec":
        """Build a cluster taking hardware defaults from ``profiles/hardware/<device>.json``.

        ``overrides`` may set device_memory, intra_node_bandwidth, inter_node_bandwidth or cores_per_device;
        ``dtype`` picks another of the kind's compute dtypes (``HardwareSpec.dtypes``).
        """
        hw = load_hardware_spec(device)
        if dtype is not None and dtype not in hw.compute_dtypes:
            raise ValueError(f"cluster {nodelist!r}: device kind {device!r} computes in "
                             f"{', '.join(hw.compute_dtypes)}, not {dtype!r}; set dtype to one of those (or leave "
                             f"it out for {hw.dtype})")
        dtype = None if dtype == hw.dtype else dtype
        # Only None means "the hardware's default": 0 is a mistake that ClusterSpec reports.
        n = hw.default_devices_per_node if n_devices_per_node is None else _check_devices_per_node(n_devices_per_node)
        # A host whose cores are known splits them among its devices (e.g. 4 CPU devices on 2 cores: 0.5).
        cores = min(hw.cores_per_device, hw.cores_per_node / n) if hw.cores_per_node else hw.cores_per_device
        fields = dict(device_memory=int(hw.memory_bytes * hw.usable_memory_fraction),
                      intra_node_bandwidth=hw.intra_node_bandwidth, inter_node_bandwidth=hw.inter_node_bandwidth,
                      cores_per_device=cores)
        for key, value in overrides.items():
            if key not in fields:
                raise ValueError(f"unknown cluster setting {key!r}; settable: {', '.join(fields)}")
            if value is not None:
                fields[key] = type(fields[key])(value)
        return cls(nodelist=nodelist, n_devices_per_node=n, device=device, dtype=dtype, **fields)

    @classmethod
    def from_pools(cls, pools: "Sequence[Pool | Mapping[str, Any]]", link_bandwidth: float | None = None,
                   link_latency: float | None = None) -> "ClusterSpec":
        """A cluster of pools of device kinds (``Pool``, in global device id order); ``link_bandwidth`` (bytes/s per
        device) and ``link_latency`` (s) describe the link between pools, by default the slower pool's inter-node
        link. One pool is exactly ``from_nodelist``'s cluster."""
        return _pooled_cluster(cls, pools, link_bandwidth, link_latency)

    @cached_property
    def hardware(self) -> HardwareSpec:
        """The device kind's spec in the dtype the devices compute in; with pools, the first pool's."""
        if self.pools:
            return self.pools[0].hardware
        hw = load_hardware_spec(self.device)
        return hw.model_copy(update={"dtype": self.dtype}) if self.dtype and self.dtype != hw.dtype else hw

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_devices(self) -> int:
        if self.pools:
            return sum(p.n_devices for p in self.pools)
        return self.n_nodes * self.n_devices_per_node

    @cached_property
    def pool_offsets(self) -> tuple[int, ...]:
        """The first global device id of each pool (one pool: ``(0,)``)."""
        sizes = [p.n_devices for p in self.pools] or [self.n_devices]
        return tuple(sum(sizes[:i]) for i in range(len(sizes)))

    def pool_cluster(self, pool: int) -> "ClusterSpec":
        """Pool ``pool`` as a one-kind cluster of its own (device ids from 0); a one-pool cluster is itself."""
        return self.pools[pool] if self.pools else self

    def pool_of_device(self, device_id: int) -> int:
        return max(i for i, off in enumerate(self.pool_offsets) if off <= device_id)

    def memory_of(self, mesh: DeviceMesh) -> int:
        """Usable bytes of one device of ``mesh`` (its pool's)."""
        return self.pool_cluster(mesh.pool).device_memory

    @property
    def whole(self) -> DeviceMesh:
        if self.pools:
            raise ValueError(f"cluster {self.nodelist!r} has {len(self.pools)} pools and no mesh spans them; "
                             f"take a pool's whole mesh (ClusterSpec.pool_cluster)")
        return DeviceMesh(self.nodes, 0, 0, self.n_devices_per_node, self.n_devices_per_node)

    def node_of(self, device_id: int) -> int:
        if self.pools:
            p = self.pool_of_device(device_id)
            before = sum(q.n_nodes for q in self.pools[:p])
            return before + self.pools[p].node_of(device_id - self.pool_offsets[p])
        return device_id // self.n_devices_per_node

    def local_device(self, device_id: int) -> int:
        """The index of a global device id inside its node (its pool's node size)."""
        pool = self.pool_of_device(device_id) if self.pools else 0
        return (device_id - self.pool_offsets[pool]) % self.pool_cluster(pool).n_devices_per_node

    def device_name(self, device_id: int) -> str:
        """``node:local index`` of a global device id (``com02:3``)."""
        return f"{self.nodes[self.node_of(device_id)]}:{self.local_device(device_id)}"

    def device_meshes(self) -> list[DeviceMesh]:
        """Every valid mesh: aligned power-of-two blocks inside a node, then runs of whole nodes (pool by pool)."""
        if self.pools:
            return [dataclasses.replace(mesh, device_offset=off, pool=i)
                    for i, (pool, off) in enumerate(zip(self.pools, self.pool_offsets)) for mesh in pool.device_meshes()]
        m = self.n_devices_per_node
        out: list[DeviceMesh] = []
        for i, node in enumerate(self.nodes):
            size = 1
            while size < m:
                out.extend(DeviceMesh((node,), i, start, size, m) for start in range(0, m, size))
                size *= 2
        for k in range(1, self.n_nodes + 1):
            out.extend(DeviceMesh(self.nodes[i:i + k], i, 0, m, m) for i in range(self.n_nodes - k + 1))
        return out

    def mesh(self, name: str) -> DeviceMesh:
        """Parse a mesh name (``com[01-02]``, ``com01``, ``com01:0-3``, ``com01:2``) against this cluster."""
        if self.pools:
            return _pool_mesh(self, name)
        m = self.n_devices_per_node
        node_part, _, dev_part = name.partition(":")
        try:
            nodes = parse_nodelist(node_part)
        except ValueError as e:
            raise ValueError(f"mesh {name!r}: {e}") from None
        missing = [n for n in nodes if n not in self.nodes]
        if missing:
            raise ValueError(f"mesh {name!r} names node {missing[0]!r}, which is not in the cluster "
                             f"{self.nodelist!r}")
        first = self.nodes.index(nodes[0])
        if self.nodes[first:first + len(nodes)] != nodes:
            raise ValueError(f"mesh {name!r}: nodes must be a consecutive run of the cluster {self.nodelist!r}")
        if not dev_part:
            return DeviceMesh(nodes, first, 0, m, m)
        if len(nodes) != 1:
            raise ValueError(f"mesh {name!r}: a device range is allowed only inside one node")
        rng = re.fullmatch(r"(\d+)(?:-(\d+))?", dev_part)
        if not rng:
            raise ValueError(f"mesh {name!r}: bad device range {dev_part!r} (expected e.g. 0-3)")
        lo = int(rng.group(1))
        hi = int(rng.group(2) or lo)
        size = hi - lo + 1
        if hi >= m:
            raise ValueError(f"mesh {name!r}: device {hi} is out of range; node {nodes[0]} has devices "
                             f"{'0' if m == 1 else f'0-{m - 1}'}")
        if size < 1 or size & (size - 1) or lo % size:
            raise ValueError(f"mesh {name!r}: devices {lo}-{hi} are not an aligned power-of-two block of a "
                             f"{m}-device node")
        return DeviceMesh(nodes, first, lo, size, m)

    def describe(self) -> str:
        if self.pools:
            return "\n           ".join([f"{self.nodelist}: {len(self.pools)} pools, linked at "
                                         f"{self.pool_link_bandwidth / 1e9:.1f} GB/s, {self.pool_link_latency * 1e6:g} us"]
                                        + [f"pool {i}: {p.describe()}" for i, p in enumerate(self.pools)])
        hw = self.hardware
        usable = (f" usable (of {hw.memory_bytes / 2**30:.1f})" if self.device_memory < hw.memory_bytes else "")
        return (f"{self.nodelist}: {self.n_nodes} node(s) x {self.n_devices_per_node} {self.device} device(s), "
                f"{self.device_memory / 2**30:.1f} GiB each{usable}, "
                f"intra-node {self.intra_node_bandwidth / 1e9:.1f} GB/s, "
                f"inter-node {self.inter_node_bandwidth / 1e9:.1f} GB/s, {self.cores_per_device:g} core(s)/device "
                f"({hw.dtype})")


@dataclasses.dataclass(frozen=True)
class Pool:
    """One pool of a heterogeneous cluster: nodes of one device kind (``profiles/hardware/<device>.json``).

    ``None`` takes the kind's default; ``device_memory`` is the usable bytes per device, ``dtype`` one of the
    kind's compute dtypes (``HardwareSpec.dtypes``: V100s have no bf16, so fp16).
    """

    nodelist: str
    device: str = "cpu"
    n_devices_per_node: int | None = None
    dtype: str | None = None
    device_memory: int | None = None
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    cores_per_device: float | None = None

    @classmethod
    def of(cls, pool: "Pool | Mapping[str, Any]", where: str) -> "Pool":
        if isinstance(pool, Pool):
            return pool
        if not isinstance(pool, Mapping):
            raise ValueError(f"{where}: a pool is a Pool(...) or a dict of its fields, not {type(pool).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(pool) - fields)
        if unknown:
            raise ValueError(f"{where}: unknown pool field {unknown[0]!r}; fields: {', '.join(sorted(fields))}")
        if "nodelist" not in pool:
            raise ValueError(f"{where}: a pool needs a nodelist, e.g. {{'nodelist': 'v100-[01-02]', "
                             f"'device': 'v100-32g'}}")
        return cls(**pool)

    def cluster(self) -> ClusterSpec:
        overrides = {k: getattr(self, k) for k in ("device_memory", "intra_node_bandwidth", "inter_node_bandwidth",
                                                   "cores_per_device")}
        return ClusterSpec.from_nodelist(self.nodelist, self.n_devices_per_node, self.device, dtype=self.dtype,
                                         **overrides)


def _pooled_cluster(cls: type[ClusterSpec], pools: Sequence[Pool | Mapping[str, Any]], link_bandwidth: float | None,
                    link_latency: float | None) -> ClusterSpec:
    if isinstance(pools, (str, Mapping)) or not pools:
        raise ValueError("pools must be a non-empty list of pools, e.g. [Pool('a100-[01]', 'a100-80g'), "
                         "Pool('v100-[01-02]', 'v100-32g', 4)]")
    specs = []
    for i, p in enumerate(pools):
        pool = Pool.of(p, f"pool {i}")
        try:
            specs.append(pool.cluster())
        except ValueError as e:
            raise ValueError(f"pool {i}: {e}") from None
    for field, value, ok in (("pool_link_bandwidth", link_bandwidth, lambda v: v > 0),
                             ("pool_link_latency", link_latency, lambda v: v >= 0)):
        if value is not None and len(specs) == 1:
            raise ValueError(f"{field}: one pool has no link to another pool; leave {field} out")
        if value is not None and not (isinstance(value, (int, float)) and ok(value)):
            raise ValueError(f"{field} must be a {'positive' if field.endswith('width') else 'non-negative'} "
                             f"number, got {value!r}")
    if len(specs) == 1:
        return specs[0]
    seen: dict[str, int] = {}
    for i, c in enumerate(specs):
        for n in c.nodes:
            if n in seen:
                raise ValueError(f"node {n!r} is in pool {seen[n]} and pool {i}; a node belongs to one pool (its "
                                 f"devices are of one kind)")
            seen[n] = i
    slow = min(specs, key=lambda c: c.inter_node_bandwidth)  # the default link: the slower pool's inter-node one
    return cls(nodelist=",".join(c.nodelist for c in specs), n_devices_per_node=max(c.n_devices_per_node for c in specs),
               device="+".join(c.device for c in specs), device_memory=max(c.device_memory for c in specs),
               intra_node_bandwidth=min(c.intra_node_bandwidth for c in specs),
               inter_node_bandwidth=min(c.inter_node_bandwidth for c in specs),
               cores_per_device=min(c.cores_per_device for c in specs), pools=tuple(specs),
               pool_link_bandwidth=float(slow.inter_node_bandwidth if link_bandwidth is None else link_bandwidth),
               pool_link_latency=float(slow.hardware.inter_node_latency if link_latency is None else link_latency))


def _pool_mesh(cluster: ClusterSpec, name: str) -> DeviceMesh:
    """A mesh name against a cluster of pools: it must lie inside one pool."""
    node_part = name.partition(":")[0]
    try:
        nodes = parse_nodelist(node_part)
    except ValueError as e:
        raise ValueError(f"mesh {name!r}: {e}") from None
    owners = []
    for n in nodes:
        owner = next((i for i, p in enumerate(cluster.pools) if n in p.nodes), None)
        if owner is None:
            raise ValueError(f"mesh {name!r} names node {n!r}, which is not in the cluster {cluster.nodelist!r}")
        owners.append(owner)
    if len(set(owners)) > 1:
        a, b = sorted(set(owners))[:2]
        raise ValueError(f"mesh {name!r} spans pool {a} ({cluster.pools[a].device}) and pool {b} "
                         f"({cluster.pools[b].device}); a mesh lies inside one pool: place the call on nodes of "
                         f"one pool")
    i = owners[0]
    return dataclasses.replace(cluster.pools[i].mesh(name), device_offset=cluster.pool_offsets[i], pool=i)

