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

from realloc.estimator.hardware import HardwareSpec, load_hardware_spec

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
        return tuple((self.first_node + i) * self.devices_per_node + self.dev_start + j
                     for i in range(self.n_nodes) for j in range(self.n_devs))

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

    def __post_init__(self) -> None:
        if not self.nodes:
            object.__setattr__(self, "nodes", parse_nodelist(self.nodelist))
        _check_devices_per_node(self.n_devices_per_node)
        for field in ("device_memory", "intra_node_bandwidth", "inter_node_bandwidth", "cores_per_device"):
            if getattr(self, field) <= 0:
                raise ValueError(f"cluster {self.nodelist!r}: {field} must be positive")

    @classmethod
    def from_nodelist(cls, nodelist: str, n_devices_per_node: int | None = None, device: str = "cpu",
                      **overrides: float) -> "ClusterSpec":
        """Build a cluster taking hardware defaults from ``profiles/hardware/<device>.json``.

        ``overrides`` may set device_memory, intra_node_bandwidth, inter_node_bandwidth or cores_per_device.
        """
        hw = load_hardware_spec(device)
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
        return cls(nodelist=nodelist, n_devices_per_node=n, device=device, **fields)

    @cached_property
    def hardware(self) -> HardwareSpec:
        return load_hardware_spec(self.device)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.n_devices_per_node

    @property
    def whole(self) -> DeviceMesh:
        return DeviceMesh(self.nodes, 0, 0, self.n_devices_per_node, self.n_devices_per_node)

    def node_of(self, device_id: int) -> int:
        return device_id // self.n_devices_per_node

    def device_meshes(self) -> list[DeviceMesh]:
        """Every valid mesh: aligned power-of-two blocks inside a node, then runs of whole nodes."""
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
        hw = self.hardware
        usable = (f" usable (of {hw.memory_bytes / 2**30:.1f})" if self.device_memory < hw.memory_bytes else "")
        return (f"{self.nodelist}: {self.n_nodes} node(s) x {self.n_devices_per_node} {self.device} device(s), "
                f"{self.device_memory / 2**30:.1f} GiB each{usable}, "
                f"intra-node {self.intra_node_bandwidth / 1e9:.1f} GB/s, "
                f"inter-node {self.inter_node_bandwidth / 1e9:.1f} GB/s, {self.cores_per_device:g} core(s)/device "
                f"({hw.dtype})")

