"""Per-token statistics of logits that are split over the vocabulary by tensor parallelism.

With TP the LM head is column-parallel: tp rank r holds logits for the vocabulary
slice [r*V/tp, (r+1)*V/tp). Log-probabilities and entropies need the softmax
normalizer over the whole vocabulary, which is a max and a sum over the shards;
we all-reduce those two scalars per token instead of gathering V/tp-wide logits.

Columns of the vocabulary padding hold -inf (``llama.LlamaStage.head``): exp() makes them 0 in
every normalizer, so these functions see only the real vocabulary without being told its size.

Every function returns the same tensor on all tp ranks and is differentiable:
the reductions use megatron's ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward), which is the right adjoint because
every tp rank computes the same downstream loss from the reduced values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


def _global_max(local_logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # The max only stabilizes exp(); it cancels in the result, so no gradient flows through it.
    m = local_logits.detach().amax(dim=-1).contiguous()
    if group.size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return m


def vocab_parallel_log_normalizer(local_logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """log(sum over the full vocabulary of exp(logits)), shape ``local_logits.shape[:-1]``; computed in fp32."""
    x = local_logits.float()
    m = _global_max(x, group)
    s = torch.exp(x - m.unsqueeze(-1)).sum(dim=-1).contiguous()
    s = reduce_from_tensor_model_parallel_region(s, group)
    return m + torch.log(s)


def vocab_parallel_token_logprobs(local_logits: torch.Tensor, targets: torch.Tensor,
                                  group: dist.ProcessGroup, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position; ``targets`` hold full-vocabulary ids."""
    x = local_logits.float()
    if temperature != 1.0:
        x = x / temperature
    shard = x.shape[-1]
    start = dist.get_rank(group) * shard if group.size() > 1 else 0
    local_t = targets - start
    inside = (local_t >= 0) & (local_t < shard)
    picked = torch.gather(x, -1, local_t.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(inside, picked, torch.zeros_like(picked)).contiguous()
    picked = reduce_from_tensor_model_parallel_region(picked, group)
    return picked - vocab_parallel_log_normalizer(x, group)


def vocab_parallel_entropy(local_logits: torch.Tensor, group: dist.ProcessGroup,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logZ - sum(p * logits)."""
    x = local_logits.float()
    if temperature != 1.0:
        x = x / temperature
    log_z = vocab_parallel_log_normalizer(x, group)
    p = torch.exp(x - log_z.unsqueeze(-1))
    # Padding columns: p = 0 and x = -inf, whose product (and its gradient) would be NaN; they add nothing.
    finite_x = torch.where(p > 0, x, torch.zeros_like(x))
    expected = (p * finite_x).sum(dim=-1).contiguous()
    expected = reduce_from_tensor_model_parallel_region(expected, group)
    return log_z - expected


def gather_vocab(local_logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Full-vocabulary logits on every tp rank (all-gather; use for a few positions, e.g. sampling)."""
    if group.size() == 1:
        return local_logits
    return gather_from_tensor_model_parallel_region(local_logits.contiguous(), group)
