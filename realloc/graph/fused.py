"""Fused train pairs (rlhfuse.txt §5, intra-stage fusion): two TRAIN_STEP calls of different models on the
same mesh with the same pp run as one pipeline schedule, the second model's stages in reverse order, so
that each fills the other's bubbles. This module says which pairs a plan may fuse; the schedule itself is
``realloc._C.FusedProblem`` (csrc/fused_schedule.h)."""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import networkx as nx

from realloc.cluster import DeviceMesh

if TYPE_CHECKING:
    from realloc.graph.dataflow import DataflowGraph


class Placed(Protocol):
    """What fusion reads of a call's placement (graph.plan.CallPlacement has it)."""

    mesh: str
    pp: int


def fused_pair_error(graph: "DataflowGraph", placements: Mapping[str, Placed], first: str,
                     second: str) -> str | None:
    """Why ``first`` and ``second`` cannot be fused under ``placements``, or None if they can."""
    names = graph.spec.call_names
    for c in (first, second):
        if c not in names:
            return f"call {c!r} is not in experiment {graph.spec.name!r} (calls: {', '.join(names)})"
    if first == second:
        return f"call {first!r} is fused with itself; name two different train calls"
    for c in (first, second):
        if not graph.call(c).is_train:
            return f"call {c!r} is not a TRAIN_STEP call; only two train steps can be fused"
    if graph.call(first).model_name == graph.call(second).model_name:
        return (f"calls {first!r} and {second!r} train the same model {graph.call(first).model_name!r}; "
                f"fuse train steps of two different models")
    pa, pb = placements[first], placements[second]
    if pa.mesh != pb.mesh:
        return (f"calls {first!r} (mesh {pa.mesh!r}) and {second!r} (mesh {pb.mesh!r}) must run on the same mesh "
                f"to be fused; give both the same mesh")
    if pa.pp != pb.pp:
        return (f"calls {first!r} (pp={pa.pp}) and {second!r} (pp={pb.pp}) must have the same pp to be fused; "
                f"give both the same pp")
    ma, mb = graph.call(first).n_minibatches, graph.call(second).n_minibatches
    if ma != mb:
        return (f"calls {first!r} ({ma} mini-batches) and {second!r} ({mb}) must take the same number of optimizer "
                f"steps to be fused (each step of one fuses with one of the other)")
    if nx.has_path(graph.graph, first, second) or nx.has_path(graph.graph, second, first):
        return f"calls {first!r} and {second!r} depend on each other within an iteration, so they cannot overlap"
    return None


def check_fused(graph: "DataflowGraph", placements: Mapping[str, Placed],
                pairs: Sequence[tuple[str, str]]) -> None:
    """Raise one ValueError naming the first pair that cannot be fused (or a call fused twice)."""
    seen: set[str] = set()
    for first, second in pairs:
        why = fused_pair_error(graph, placements, first, second)
        if why:
            raise ValueError(f"plan field 'fused' pair ({first!r}, {second!r}): {why}")
        for c in (first, second):
            if c in seen:
                raise ValueError(f"plan field 'fused': call {c!r} is in two fused pairs; fuse each call at most once")
            seen.add(c)


def fusable_pairs(graph: "DataflowGraph") -> list[tuple[str, str]]:
    """Pairs of train calls that could be fused under some placement (declaration order within a pair)."""
    trains = [c.name for c in graph.calls if c.is_train]
    return [(a, b) for i, a in enumerate(trains) for b in trains[i + 1:]
            if graph.call(a).model_name != graph.call(b).model_name
            and graph.call(a).n_minibatches == graph.call(b).n_minibatches
            and not nx.has_path(graph.graph, a, b) and not nx.has_path(graph.graph, b, a)]


@dataclasses.dataclass(frozen=True)
class ReversedStageMesh(DeviceMesh):
    """A mesh whose ``stage_groups`` consecutive groups of devices come in reverse order: a layout on it puts
    pipeline stage k on the mesh's group pp - 1 - k (the second call of a fused pair). Every layout,
    reallocation and data plan reads a mesh through ``device_ids``, so they all follow; the name says so."""

    stage_groups: int = 1

    @cached_property
    def device_ids(self) -> tuple[int, ...]:
        ids = DeviceMesh.device_ids.func(self)  # type: ignore[attr-defined]
        size = len(ids) // self.stage_groups
        return tuple(d for k in reversed(range(self.stage_groups)) for d in ids[k * size:(k + 1) * size])

    @property
    def name(self) -> str:
        return f"{DeviceMesh.name.fget(self)}~reversed{self.stage_groups}"  # type: ignore[attr-defined]


def reversed_stages(mesh: DeviceMesh, pp: int) -> DeviceMesh:
    """``mesh`` with its ``pp`` stage groups in reverse order (itself at pp 1)."""
    if pp == 1:
        return mesh
    return ReversedStageMesh(**{f.name: getattr(mesh, f.name) for f in dataclasses.fields(DeviceMesh)},
                             stage_groups=pp)


def second_model_meshes(graph: "DataflowGraph", meshes: Mapping[str, DeviceMesh], pps: Mapping[str, int],
                        pairs: Sequence[tuple[str, str]]) -> dict[str, DeviceMesh]:
    """Every call's mesh at run time: the second model of each fused pair runs its stages in reverse order on
    the pair's mesh, in all of its calls there, so calls that shared one layout still share it and fusing adds
    no reallocation (a call of that model at another pp on the mesh just holds its devices in another order)."""
    out = dict(meshes)
    for first, second in pairs:
        model, mesh = graph.call(second).model_name, meshes[second]
        for c in meshes:
            if graph.call(c).model_name == model and meshes[c] == mesh:
                out[c] = reversed_stages(mesh, pps[second])
    return out
