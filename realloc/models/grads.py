"""Gradient reductions of a 3D-parallel model: tied-embedding and KV-replica sync, data-parallel
average, global norm and clipping.

KV heads replicated over tp ranks (tp > n_kv_heads): each copy of a KV head serves only its own
rank's query heads, so its gradient is a partial sum; the copies' gradients are summed over the
ranks that share the head (``sync_kv_replicas``) and every copy then takes the same step.

Which copy of a parameter counts toward the global norm (each element once):
- tp-sharded parameters: every tp rank holds a distinct shard, all count;
- replicated KV-head shards: only the first rank of the ranks sharing it counts it;
- tp-replicated parameters (norms, the critic's score): identical on every tp
  rank (their gradients are identical too, after ``sync_sequence_parallel`` under sequence
  parallelism, and Qwen3's per-head q/k norms after ``sync_head_norms`` without it), only tp rank 0 counts them;
- the tied embedding's replica on the last stage (pp > 1): only stage 0 counts it;
- data-parallel replicas: gradients are averaged first, so one replica's view
  (any dp rank) is the global one and no reduction over dp is needed; with the
  distributed optimizer (``zero.py``) each dp rank holds the averaged chunks it
  steps, a disjoint part of every tensor, and the squares are summed over dp too.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from realloc.models.collective_wait import blocking
from realloc.models.groups import ModelParallelGroups
from realloc.models.param_layout import EMBED_LAYER, ParamSpec

HEAD_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # Qwen3's per-head norms (``param_layout``)
BUCKET_NUMEL = 1 << 25  # 32M elements (128 MiB fp32) per coalesced all-reduce


def _buckets(tensors: list[torch.Tensor], max_numel: int) -> Iterable[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (size + t.numel() > max_numel or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def allreduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup, average: bool,
                        max_numel: int = BUCKET_NUMEL) -> None:
    """Sum (or average) ``tensors`` in place over ``group``, a few large messages instead of one per tensor."""
    n = group.size()
    if n == 1 or not tensors:
        return
    for bucket in _buckets(tensors, max_numel):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        blocking(dist.all_reduce, flat, group=group)
        if average:
            flat.div_(n)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def sync_tied_embedding(grads: Mapping[str, torch.Tensor], groups: ModelParallelGroups, embed_name: str) -> None:
    """Sum the embedding gradient of stage 0 and the last stage's replica so both apply the same update."""
    if groups.embedding_group is not None:
        dist.all_reduce(grads[embed_name], group=groups.embedding_group)


def sync_kv_replicas(grads: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec],
                     groups: ModelParallelGroups) -> None:
    """Sum the k/v gradients of a replicated KV head over the tp ranks holding it."""
    if groups.kv_replica_group is None:
        return
    shared = [grads[n] for n in sorted(grads) if specs[n].tp_dim is not None and specs[n].tp_replicas(groups.tp) > 1]
    allreduce_coalesced(shared, groups.kv_replica_group, average=False)


def sync_sequence_parallel(grads: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec],
                           groups: ModelParallelGroups) -> None:
    """Sum the gradients of the tp-replicated parameters (norms, the critic's score) over tp: under sequence
    parallelism each rank's copy saw only its own tokens (``sequence_parallel.py``)."""
    replicated = [grads[n] for n in sorted(grads) if specs[n].tp_dim is None]
    allreduce_coalesced(replicated, groups.tp_group, average=False)


def sync_head_norms(grads: Mapping[str, torch.Tensor], groups: ModelParallelGroups) -> None:
    """Sum Qwen3's per-head q/k norm gradients over tp without sequence parallelism: each rank's copy saw only
    its own heads (with it, ``sync_sequence_parallel`` sums every replicated parameter already)."""
    if groups.tp > 1:
        allreduce_coalesced([grads[n] for n in sorted(grads) if n.endswith(HEAD_NORMS)], groups.tp_group,
                            average=False)


def average_data_parallel(grads: Mapping[str, torch.Tensor], groups: ModelParallelGroups) -> None:
    allreduce_coalesced(list(grads.values()), groups.dp_group, average=True)


def counts_toward_norm(spec: ParamSpec, groups: ModelParallelGroups) -> bool:
    if not spec.is_primary(groups.tp, groups.tp_rank):
        return False
    if spec.layer == EMBED_LAYER and groups.pp > 1 and groups.pp_rank == groups.pp - 1:
        return False  # tied replica; stage 0 owns the embedding
    return True


def global_norm(grads: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec], groups: ModelParallelGroups,
                dp_chunks: bool = False) -> float:
    """L2 norm of the whole model's gradient (``grads``: name -> this rank's gradient shard, or with
    ``dp_chunks`` this dp rank's disjoint chunk of it), same on every rank."""
    g0 = next(iter(grads.values()))
    sq = torch.zeros((), dtype=torch.float64, device=g0.device)
    for name, g in grads.items():
        if counts_toward_norm(specs[name], groups):
            # accumulates in float64 without a float64 copy of the gradient (16 bytes per element of the
            # largest tensor, the vocabulary shard, otherwise)
            sq += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    if groups.tp > 1:
        dist.all_reduce(sq, group=groups.tp_group)
    if groups.pp > 1:
        dist.all_reduce(sq, group=groups.pp_group)
    if dp_chunks and groups.dp > 1:
        blocking(dist.all_reduce, sq, group=groups.dp_group)
    return math.sqrt(float(sq))


def clip_(grads: Mapping[str, torch.Tensor], total_norm: float, max_norm: float) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; returns the factor applied."""
    if not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    for g in grads.values():
        g.mul_(coef)
    return coef


# -- the same on parameters' ``.grad`` (fp32 models keep their gradients there) ---------------------


def ensure_grads(params: Mapping[str, torch.nn.Parameter]) -> None:
    # Every rank must enter the same collectives with the same shapes, even for a parameter
    # that got no gradient this step.
    for p in params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def param_grads(params: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in params.items()}


def global_grad_norm(params: Mapping[str, torch.nn.Parameter], specs: Mapping[str, ParamSpec],
                     groups: ModelParallelGroups) -> float:
    return global_norm(param_grads(params), specs, groups)


def clip_grads(params: Mapping[str, torch.nn.Parameter], total_norm: float, max_norm: float) -> float:
    return clip_(param_grads(params), total_norm, max_norm)
