"""Per-token statistics of logits that are split over the vocabulary by tensor parallelism.

With TP the LM head is column-parallel: tp rank r holds logits for the vocabulary
slice [r*V/tp, (r+1)*V/tp). Log-probabilities and entropies need the softmax
normalizer over the whole vocabulary, which is a max and a sum over the shards;
we all-reduce those per-token scalars instead of gathering V/tp-wide logits.

Columns of the vocabulary padding hold -inf (``llama.LlamaStage.head``): exp() makes them 0 in
every normalizer, so these functions see only the real vocabulary without being told its size.

Memory (issue 21, "Memory at scale"). The logits are the largest activation of a 128k-vocabulary
model; an unfused log-softmax holds an fp32 copy of them, logits - max and its exp, and its backward
four fp32 tensors of that size. Here each statistic is a ``torch.autograd.Function`` that walks the
tokens in chunks (``config.logprob_chunk_tokens``: one fp32 [chunk, V/tp] block is bounded, not the
whole micro-batch). Its forward keeps only the input logits in their own dtype plus fp32 scalars per
token (the normalizer log Z, and for the entropy the expected logit); its backward recomputes the
softmax chunk by chunk and writes d(logits) into one tensor of the logits' dtype. At most one fp32
chunk is alive at a time (the entropy's two: the scaled logits and their exp).

Every function returns the same tensor on all tp ranks and is differentiable. The forward all-reduces
the per-token max, sum and picked (or expected) logit over ``group``; the backward of such a reduce is
the identity (each rank's gradient of its own shard needs no collective), the right adjoint because
every tp rank computes the same downstream loss from the reduced values (megatron's
``reduce_from_tensor_model_parallel_region`` has the same forward and backward). ``group=None`` means
the logits hold the whole vocabulary (sampling's gathered rows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import realloc.models.megatron_import  # noqa: F401  (first: megatron-core without torch.compile, wandb)
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from realloc.models.config import logprob_chunk_tokens

Index = tuple[Any, ...]


def _tp_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if _tp_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _rows(t: torch.Tensor, vocab_dim: bool) -> torch.Tensor:
    """``t`` as [rows, tokens(, V)]: a view, so a sliced [B, T-1, V] input is never copied."""
    lead = t.dim() - (1 if vocab_dim else 0)
    if lead < 1:
        raise ValueError(f"vocab_parallel: logits need a token dimension before the vocabulary, got {tuple(t.shape)}")
    if lead == 1:
        return t.unsqueeze(0)
    return t.flatten(0, lead - 2) if lead > 2 else t


def _chunks(rows: int, length: int, chunk_tokens: int) -> list[Index]:
    """Indices of [rows, length] that cover it with at most ``chunk_tokens`` tokens each: whole rows when a row
    fits, else pieces of one row (both are views of the logits and of the per-token tensors)."""
    if chunk_tokens >= length:
        per = max(1, chunk_tokens // max(1, length))
        return [(slice(b, min(b + per, rows)),) for b in range(0, rows, per)]
    return [(b, slice(t, min(t + chunk_tokens, length))) for b in range(rows) for t in range(0, length, chunk_tokens)]


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """The chunk in fp32 divided by the temperature: a fresh fp32 block (a copy even of fp32 logits, so it can
    be updated in place), the same values as ``x.float() / temperature``."""
    y = x.to(torch.float32, copy=True)
    if temperature != 1.0:
        y.div_(temperature)
    return y


def _check(chunk_tokens: int | None, temperature: float, local_vocab: int) -> int:
    if temperature <= 0:
        raise ValueError(f"vocab_parallel: temperature must be > 0, got {temperature}")
    if chunk_tokens is None:
        return logprob_chunk_tokens(local_vocab)
    if chunk_tokens < 1:
        raise ValueError(f"vocab_parallel: chunk_tokens must be >= 1, got {chunk_tokens}")
    return chunk_tokens


def _global_max(x: torch.Tensor, group: dist.ProcessGroup | None, temperature: float) -> torch.Tensor:
    """Per-token max of logits / temperature over the whole vocabulary, fp32. Taken on the logits themselves
    (no fp32 copy): rounding is monotone, so max(fl(x / T)) = fl(max(x) / T). It only stabilizes exp()
    and cancels in every result, so no gradient flows through it."""
    m = x.amax(dim=-1).float()
    if temperature != 1.0:
        m = m / temperature
    return _all_reduce(m.contiguous(), group, dist.ReduceOp.MAX)


def _log_normalizer(x: torch.Tensor, group: dist.ProcessGroup | None, temperature: float,
                    chunks: list[Index]) -> torch.Tensor:
    """log Z = m + log(sum exp(x / T - m)) per token of [rows, tokens, V/tp] logits, one fp32 chunk at a time."""
    m = _global_max(x, group, temperature)
    s = torch.empty_like(m)
    for idx in chunks:
        y = _scaled(x[idx], temperature)
        s[idx] = y.sub_(m[idx].unsqueeze(-1)).exp_().sum(dim=-1)
        del y  # before the next chunk is allocated: one fp32 chunk alive, not two
    _all_reduce(s, group, dist.ReduceOp.SUM)
    return m + torch.log(s)


def _softmax_chunk(x: torch.Tensor, log_z: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(x / T) of one chunk from its saved log Z: a fresh fp32 block (0 in the -inf padding columns)."""
    return _scaled(x, temperature).sub_(log_z.unsqueeze(-1)).exp_()


class _LogNormalizer(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, temperature: float,
                chunk_tokens: int) -> torch.Tensor:
        x3 = _rows(x, vocab_dim=True)
        chunks = _chunks(x3.shape[0], x3.shape[1], chunk_tokens)
        log_z = _log_normalizer(x3, group, temperature, chunks)
        ctx.save_for_backward(x, log_z)
        ctx.temperature, ctx.chunks = temperature, chunks
        return log_z.view(x.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # d log Z / d x = softmax(x / T) / T
        x, log_z = ctx.saved_tensors
        x3, g = _rows(x, vocab_dim=True), _rows(grad, vocab_dim=False)
        out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
        for idx in ctx.chunks:
            d = _softmax_chunk(x3[idx], log_z[idx], ctx.temperature).mul_(g[idx].unsqueeze(-1))
            out[idx] = d.div_(ctx.temperature) if ctx.temperature != 1.0 else d
            del d  # before the next chunk is allocated
        return out.view(x.shape), None, None, None


def _local_targets(targets: torch.Tensor, group: dist.ProcessGroup | None,
                   shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each target in this rank's shard (clamped into it) and whether the shard holds it."""
    start = dist.get_rank(group) * shard if _tp_size(group) > 1 else 0
    local = targets - start
    inside = (local >= 0) & (local < shard)
    return local.clamp(0, shard - 1), inside


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                temperature: float, chunk_tokens: int) -> torch.Tensor:
        x3 = _rows(x, vocab_dim=True)
        t2 = targets.reshape(x3.shape[:-1])
        chunks = _chunks(x3.shape[0], x3.shape[1], chunk_tokens)
        log_z = _log_normalizer(x3, group, temperature, chunks)
        local, inside = _local_targets(t2, group, x3.shape[-1])
        # gathered from the logits themselves: the same values as gathering from float(x) / T
        picked = torch.gather(x3, -1, local.unsqueeze(-1)).squeeze(-1).float()
        if temperature != 1.0:
            picked = picked / temperature
        picked = _all_reduce(torch.where(inside, picked, torch.zeros_like(picked)), group, dist.ReduceOp.SUM)
        ctx.save_for_backward(x, targets, log_z)
        ctx.group, ctx.temperature, ctx.chunks = group, temperature, chunks
        return (picked - log_z).view(x.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # d(x_target / T - log Z) / d x = (onehot(target) - softmax(x / T)) / T, on each rank for its shard
        x, targets, log_z = ctx.saved_tensors
        x3, g = _rows(x, vocab_dim=True), _rows(grad, vocab_dim=False)
        local, inside = _local_targets(targets.reshape(x3.shape[:-1]), ctx.group, x3.shape[-1])
        g_at_target = torch.where(inside, g, torch.zeros_like(g))
        out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
        for idx in ctx.chunks:
            d = _softmax_chunk(x3[idx], log_z[idx], ctx.temperature).mul_(g[idx].neg().unsqueeze(-1))
            d.scatter_add_(-1, local[idx].unsqueeze(-1), g_at_target[idx].unsqueeze(-1))
            out[idx] = d.div_(ctx.temperature) if ctx.temperature != 1.0 else d
            del d  # before the next chunk is allocated
        return out.view(x.shape), None, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, temperature: float,
                chunk_tokens: int) -> torch.Tensor:
        # H = log Z - E[y] with y = x / T and E[y] = sum(exp(y - m) * y) / sum(exp(y - m)): both sums in one pass
        x3 = _rows(x, vocab_dim=True)
        chunks = _chunks(x3.shape[0], x3.shape[1], chunk_tokens)
        m = _global_max(x3, group, temperature)
        sums = torch.empty((2,) + m.shape, dtype=torch.float32, device=x.device)  # [sum exp, sum exp * y]
        lowest = torch.finfo(torch.float32).min
        for idx in chunks:
            y = _scaled(x3[idx], temperature)
            e = (y - m[idx].unsqueeze(-1)).exp_()
            sums[0][idx] = e.sum(dim=-1)
            # Padding columns: e = 0 and y = -inf, whose product would be NaN; as the lowest float it is 0.
            sums[1][idx] = e.mul_(y.clamp_(min=lowest)).sum(dim=-1)
            del y, e  # before the next chunk is allocated
        _all_reduce(sums, group, dist.ReduceOp.SUM)
        log_z = m + torch.log(sums[0])
        expected = sums[1] / sums[0]
        ctx.save_for_backward(x, log_z, expected)
        ctx.temperature, ctx.chunks = temperature, chunks
        return (log_z - expected).view(x.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # dH/dy_j = -p_j (y_j - E[y]); d/dx = (d/dy) / T
        x, log_z, expected = ctx.saved_tensors
        x3, g = _rows(x, vocab_dim=True), _rows(grad, vocab_dim=False)
        out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
        lowest = torch.finfo(torch.float32).min
        for idx in ctx.chunks:
            y = _scaled(x3[idx], ctx.temperature)
            p = (y - log_z[idx].unsqueeze(-1)).exp_()
            # padding: p = 0 times a finite (lowest - E) is 0, not NaN
            d = y.clamp_(min=lowest).sub_(expected[idx].unsqueeze(-1)).mul_(p).mul_(g[idx].neg().unsqueeze(-1))
            del y, p
            out[idx] = d.div_(ctx.temperature) if ctx.temperature != 1.0 else d
            del d  # before the next chunk is allocated
        return out.view(x.shape), None, None, None


def vocab_parallel_log_normalizer(local_logits: torch.Tensor, group: dist.ProcessGroup | None,
                                  temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """log(sum over the full vocabulary of exp(logits / temperature)), shape ``local_logits.shape[:-1]``, fp32.
    ``chunk_tokens`` (default ``config.logprob_chunk_tokens``) bounds the fp32 block in flight."""
    chunk = _check(chunk_tokens, temperature, local_logits.shape[-1])
    return _LogNormalizer.apply(local_logits, group, temperature, chunk)


def vocab_parallel_token_logprobs(local_logits: torch.Tensor, targets: torch.Tensor,
                                  group: dist.ProcessGroup | None, temperature: float = 1.0,
                                  chunk_tokens: int | None = None) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position, fp32; ``targets`` hold full-vocabulary ids."""
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_token_logprobs: targets {tuple(targets.shape)} must have the logits' "
                         f"shape without the vocabulary, {tuple(local_logits.shape[:-1])}")
    chunk = _check(chunk_tokens, temperature, local_logits.shape[-1])
    return _TokenLogprobs.apply(local_logits, targets, group, temperature, chunk)


def vocab_parallel_entropy(local_logits: torch.Tensor, group: dist.ProcessGroup | None,
                           temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, fp32: logZ - sum(p * logits / temperature)."""
    chunk = _check(chunk_tokens, temperature, local_logits.shape[-1])
    return _Entropy.apply(local_logits, group, temperature, chunk)


def gather_vocab(local_logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Full-vocabulary logits on every tp rank (all-gather; use for a few positions, e.g. sampling)."""
    if group.size() == 1:
        return local_logits
    return gather_from_tensor_model_parallel_region(local_logits.contiguous(), group)
