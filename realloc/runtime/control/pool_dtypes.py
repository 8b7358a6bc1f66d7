"""A run on pools of different dtypes (docs/heterogeneous.md, issue 32): who casts, and what never crosses.

Each layout holds its model's parameters in its pool's dtype (``RuntimeProgram.dtype_of``): fp32 on ``cpu``,
bf16 on ``cpu-bf16`` and the bf16 GPUs, fp16 on V100s. A train step keeps its own dtype's optimizer state
where its model's home is (fp32 master weights for a 16-bit dtype, ``models/optim.py``, ``models/zero.py``).

Cast on receive. A reallocation sends the sender's values in the sender's dtype (the bytes the estimator
prices on the pool link, ``estimator/pool_link.py``); a receiver of another dtype receives them into a
buffer of the sender's dtype and copies them into its own tensors. That copy is torch's ``copy_`` cast, the
one ``load_hf_checkpoint`` makes from a checkpoint's tensors (``hf_io._read_shard``), so what a receiver
holds equals, bit for bit, the sender's parameters saved as a checkpoint and loaded in the receiver's dtype.

Home keeps its copy. A trip from the home layout through a dtype that cannot hold the home's values exactly
(fp32 -> bf16, bf16 -> fp16, fp16 -> bf16) and back would round the home's parameters every iteration: an
fp32 model would train on bf16 weights, without master weights. So a reallocation that leaves home for such a
dtype keeps the home's parameters (the source is not released), and the reallocation that comes back into
home is skipped by every rank: home already holds them, and no train step ran in between (every train call of
the model runs at home, or nothing is kept). Casts to fp32 are exact, so a trip from a 16-bit home through an
fp32 layout moves as it does on one pool. The kept copy costs the home's devices one copy of the parameters
while the model runs elsewhere, which the planner counts (home's parameters are home's static memory), and the
planner prices the skipped way back at 0 with this rule (search/home_keep.py, csrc/home_keep.cpp).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, MutableMapping

import torch

from realloc.models.engine import ParallelModel
from realloc.runtime.control.program import Realloc, RuntimeProgram
from realloc.runtime.transfer.param_realloc import Reallocator, ReallocStats

from realloc.cluster import LOCAL_DEVICE_ENV  # noqa: F401  (re-exported: the worker reads it from here)

RouteKey = tuple[str, str, str]  # (model, src_call, dst_call) of a Realloc


def casts_exactly(src: str, dst: str) -> bool:
    """Every value of torch dtype ``src`` is a value of ``dst`` (a round trip loses nothing)."""
    return src == dst or dst == "float32"


def route_key(r: Realloc) -> RouteKey:
    return (r.model, r.src_call, r.dst_call)


@dataclasses.dataclass(frozen=True)
class DtypeRoutes:
    """Reallocations whose source keeps its parameters (``keep``) and those into home that are skipped
    (``skip``); both empty on one pool or where every trip casts exactly."""

    keep: frozenset[RouteKey] = frozenset()
    skip: frozenset[RouteKey] = frozenset()

    @classmethod
    def of(cls, program: RuntimeProgram) -> "DtypeRoutes":
        keep: set[RouteKey] = set()
        skip: set[RouteKey] = set()
        for model in program.models:
            if program.is_rule(model):
                continue
            home = program.calls[program.home_call(model)]
            if any(program.graph.call(c).is_train and program.calls[c].key != home.key
                   for c in program.fresh_calls(model)):
                continue  # a train step away from home changes the parameters on the way: nothing to keep
            home_dtype = program.dtype_of(home.call)[0]
            kept = False
            for r in program.reallocs(model):  # the wrap (leaving home) first, then chain order
                if r.snapshot:
                    continue  # a snapshot copies and keeps its source anyway
                src, dst = program.calls[r.src_call], program.calls[r.dst_call]
                if dst.key == home.key and kept:
                    skip.add(route_key(r))
                    kept = False
                elif src.key == home.key and not casts_exactly(home_dtype, program.dtype_of(r.dst_call)[0]):
                    keep.add(route_key(r))
                    kept = True
        return cls(frozenset(keep), frozenset(skip))


def reallocate_model(reallocator: Reallocator, program: RuntimeProgram, r: Realloc, src: ParallelModel | None,
                     dst: ParallelModel | None, device: torch.device | str, drop_src: bool) -> ReallocStats:
    """Run reallocation ``r`` on this rank between its models in the source and destination layouts (None where
    the rank holds none): skipped where home kept its parameters, cast on receive, and the source released
    after (``drop_src``) unless it is a home that keeps them."""
    routes = DtypeRoutes.of(program)
    stats = ReallocStats(0, 0, 1.0, 0, 0, 0, 0, 0.0)  # home kept its parameters: nothing comes back
    if route_key(r) not in routes.skip:
        stats = reallocate_cast(reallocator, program, r, src.params() if src else None,
                                dst.params() if dst else None, device)
    if src is not None and drop_src and route_key(r) not in routes.keep:
        src.release()
    return stats


@torch.no_grad()
def reallocate_cast(reallocator: Reallocator, program: RuntimeProgram, r: Realloc,
                    src: Mapping[str, torch.Tensor] | None, dst: MutableMapping[str, torch.Tensor] | None,
                    device: torch.device | str) -> ReallocStats:
    """Move ``src`` (this rank's shards in the source layout, in the sender's dtype) into ``dst`` (its shards in
    the destination layout, in the receiver's dtype) as ``r``'s plan says, cast on receive."""
    plan = program.realloc_plan(r)
    wire = getattr(torch, program.dtype_of(r.src_call)[0])
    if not dst or all(t.dtype == wire for t in dst.values()):
        return reallocator.reallocate(plan, src, dst, dtype=wire, device=device)[1]
    staged, stats = reallocator.reallocate(plan, src, None, dtype=wire, device=device)
    for name, t in dst.items():
        if name in staged:
            t.copy_(staged[name])  # the checkpoint loader's cast (hf_io._read_shard)
    return stats
