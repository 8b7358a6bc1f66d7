"""Sequence parallelism: the tokens of the residual stream split over the tp group.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.2.2), as
Megatron-LM does it: outside the tensor-parallel regions (the norms, the residual adds, and so the layer
inputs that activation recomputation keeps) every tp rank holds 1/tp of the tokens instead of all of them.
Each all-reduce of the plain tensor-parallel block becomes a pair:

- before the column-parallel projections (q/k/v, gate/up, the LM head): **all-gather** the tokens
  (its backward reduce-scatters the input gradient, which replaces that layer's input-gradient all-reduce);
- after the row-parallel projections (o, down): **reduce-scatter** the partial sums (its backward
  all-gathers), where plain tp all-reduces them.

A ring all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved per rank stay the same
(``estimator/opcount.py`` prices the pair). The column-parallel projections (``gather_project``) keep only the
rank's tokens for their backward and all-gather them again there, as Megatron's sequence-parallel linear
layers do: one more all-gather per projection group in the backward buys the saved h-wide tensor of every
token.

Layout choice: the engine's activations are ``[B, T, h]``. We split the flattened ``B*T`` tokens, padded
with zero rows to a multiple of tp, rather than T alone: padding costs at most tp - 1 tokens per
micro-batch (not tp - 1 per row), and the collectives work on contiguous first-dim segments, which the
native ``all_gather_single`` / ``reduce_scatter_single`` (NCCL and torch 2.13's gloo alike) take as they are.
So a rank's share of the residual stream is ``[local, h]`` with ``local = ceil(B*T / tp)``; pipeline stages
send that (1/tp of the bytes). Attention and the head see the gathered ``[B, T, ...]`` tokens, padding cut
off. Padding rows stay zero-gradient (the gather drops them), so they never reach a weight's gradient.

The norms' (and a critic's ``score``) weights are replicated over tp but now see only their rank's tokens:
their gradients are partial sums that ``grads.sync_sequence_parallel`` adds up over tp after the backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    """How one micro-batch of ``batch x seq`` tokens is split over the tp ``group``."""

    group: dist.ProcessGroup
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def local(self) -> int:
        """Tokens per rank, padding included."""
        return -(-self.tokens // self.group.size())

    @property
    def padded(self) -> int:
        return self.local * self.group.size()

    def local_shape(self, hidden: int) -> tuple[int, int]:
        return (self.local, hidden)

    # -- the mappings -----------------------------------------------------------------------------

    def gather_replicated(self, x: torch.Tensor) -> torch.Tensor:
        """``[local, ...]`` -> ``[B, T, ...]`` for work every tp rank then repeats (a critic's values):
        the gradient of the result is already whole on every rank, so the backward keeps the rank's slice.
        (The column-parallel projections gather with ``gather_project``, whose backward reduce-scatters.)"""
        return _GatherReplicated.apply(x, self)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[local, ...]`` -> ``[B, T, ...]`` for work the ranks then split (a LoRA adapter's r-wide input to
        its column-parallel B): the backward reduce-scatters the ranks' partial gradients, as
        ``gather_project`` does for the h-wide input."""
        return _GatherTokens.apply(x, self)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Partial sums ``[B, T, h]`` of a row-parallel projection -> the rank's summed ``[local, h]``;
        backward all-gathers."""
        return _ReduceScatterTokens.apply(x, self)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, h]``, the same on every rank (the embedding's all-reduced output) -> the rank's
        ``[local, h]``; backward all-gathers the slices' gradients into the whole one."""
        return _ScatterTokens.apply(x, self)

    # -- helpers on plain tensors (no autograd) ---------------------------------------------------

    def _pad(self, flat: torch.Tensor) -> torch.Tensor:
        """``[tokens, ...]`` -> ``[padded, ...]``, zero rows appended (no copy when tp divides the tokens)."""
        if self.padded == self.tokens:
            return flat.contiguous()
        out = flat.new_zeros((self.padded,) + tuple(flat.shape[1:]))
        out[:self.tokens] = flat
        return out

    def _unpad(self, full: torch.Tensor) -> torch.Tensor:
        """``[padded, ...]`` -> ``[B, T, ...]``."""
        return full[:self.tokens].view((self.batch, self.seq) + tuple(full.shape[1:]))

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        full = local.new_empty((self.padded,) + tuple(local.shape[1:]))
        dist.all_gather_single(full, local, group=self.group)
        return full

    def _reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        out = full.new_empty((self.local,) + tuple(full.shape[1:]))
        dist.reduce_scatter_single(out, full, group=self.group)
        return out

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        r = self.group.rank()
        return full[r * self.local:(r + 1) * self.local]


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        ctx.split = split
        return split._unpad(split._all_gather(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split: TokenSplit = ctx.split
        return split._slice(split._pad(grad.reshape((split.tokens,) + tuple(grad.shape[2:])))).clone(), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        ctx.split = split
        return split._unpad(split._all_gather(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split: TokenSplit = ctx.split
        return split._reduce_scatter(split._pad(grad.reshape((split.tokens,) + tuple(grad.shape[2:])))), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        ctx.split = split
        return split._reduce_scatter(split._pad(x.reshape((split.tokens,) + tuple(x.shape[2:]))))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split: TokenSplit = ctx.split
        return split._unpad(split._all_gather(grad)), None


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        ctx.split = split
        # a copy, so the whole input can be freed once the caller drops it
        return split._slice(split._pad(x.reshape((split.tokens,) + tuple(x.shape[2:])))).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split: TokenSplit = ctx.split
        return split._unpad(split._all_gather(grad)), None


# -- the projections of a tensor-parallel block under sequence parallelism ---------------------------
# The megatron layers hold the weights; under sequence parallelism we apply them with F.linear, since the
# gather and reduce-scatter take the place of the layers' own input-gradient and output all-reduces.


def row_parallel(layer: torch.nn.Module, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
    """A RowParallelLinear (no bias) whose partial sums are reduce-scattered over the tokens."""
    assert layer.bias is None, "row-parallel biases would be added once per rank"
    out = split.reduce_scatter(torch.nn.functional.linear(x, layer.weight))
    delta = _lora_delta(layer, x, split)
    return out if delta is None else out + delta


def _lora_delta(layer: torch.nn.Module, x: torch.Tensor, split: TokenSplit) -> torch.Tensor | None:
    """A LoRA adapter's term on ``layer`` (``models/lora.py`` attaches it as ``layer.lora``), or None."""
    adapter = getattr(layer, "lora", None)
    if adapter is None or not adapter.active():
        return None
    return adapter.delta_sp(x, split)


def gather_project(split: TokenSplit, x: torch.Tensor, layers: "tuple[torch.nn.Module, ...]",
                   weight: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The column-parallel ``layers`` (their weights and biases; ``weight`` replaces a single layer's, for a
    tied head) on the all-gathered tokens of ``x`` (``[local, h]``), one ``[B, T, out]`` per layer.

    Autograd keeps only the rank's ``[local, h]`` tokens and gathers them again in the backward, as Megatron's
    sequence-parallel linear layers do: the gathered copy (all tokens, h wide) would otherwise be the largest
    h-wide tensor a block saves. The input gradient is summed over the layers, then reduce-scattered."""
    weights = [layer.weight if weight is None else weight for layer in layers]
    biases = [layer.bias for layer in layers]
    outs = _GatherProject.apply(x, split, len(layers), *weights, *biases)
    deltas = [_lora_delta(layer, x, split) for layer in layers]
    return tuple(o if d is None else o + d for o, d in zip(outs, deltas))


class _GatherProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: TokenSplit, n: int, *params: torch.Tensor | None
                ) -> tuple[torch.Tensor, ...]:
        weights, biases = params[:n], params[n:]
        full = split._unpad(split._all_gather(x))
        ctx.split, ctx.has_bias = split, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        split: TokenSplit = ctx.split
        x, *weights = ctx.saved_tensors
        need_w = any(ctx.needs_input_grad[3:3 + len(weights)])
        full = split._unpad(split._all_gather(x)).reshape(split.tokens, -1) if need_w else None
        grad_x = None
        grad_w, grad_b = [], []
        for i, (g, w, has_bias) in enumerate(zip(grads, weights, ctx.has_bias)):
            g = g.reshape(split.tokens, -1)
            grad_x = g @ w if grad_x is None else grad_x.addmm_(g, w)
            # a frozen weight (LoRA's base) needs no gradient
            grad_w.append(g.t() @ full if ctx.needs_input_grad[3 + i] else None)
            grad_b.append(g.sum(0) if has_bias else None)
        del full
        return (split._reduce_scatter(split._pad(grad_x)), None, None, *grad_w, *grad_b)
