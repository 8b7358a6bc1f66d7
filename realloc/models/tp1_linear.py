"""A megatron tensor-parallel linear layer's forward, minus its per-call Python where tp is 1 (docs/speed.md).

On a small model every operator is cheap and the Python around it is not: megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` run an autograd Function with amp decorators and options realloc never sets, wrapped in two
identity region Functions (copy to / reduce from the tp region, both nothing at tp 1). ``project`` runs the same
arithmetic without them where nothing else can differ: tp 1, and no hooks on the layer (LoRA's adapters are
forward hooks, which need the layer's own call). Results are bit for bit megatron's (tests/test_speed_paths.py):

- without autograd: ``matmul(x, w.t())``, then ``+ bias``, as megatron's Function forward computes them;
- with autograd: ``_Linear``, whose forward is that and whose backward is megatron's at tp 1 without gradient
  accumulation fusion: ``grad_x = g @ w``, ``grad_w = g2.t() @ x2`` on 2-D contiguous views, ``grad_b = g2.sum(0)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = torch.matmul(x, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return grad_x, None, None
        g2, x2 = g.contiguous(), x.contiguous()
        if g2.dim() == 3:  # [b, t, h] -> [b * t, h], as megatron's wgrad input preparation
            g2, x2 = g2.view(-1, g2.shape[2]), x2.view(-1, x2.shape[2])
        grad_w = g2.t().matmul(x2) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def project(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``layer(x)[0]`` of a megatron ``ColumnParallelLinear`` or ``RowParallelLinear`` (``weight``: a tied head's)."""
    if layer.tp_group.size() > 1 or layer._forward_hooks or layer._forward_pre_hooks:
        return layer(x)[0] if weight is None else layer(x, weight=weight)[0]
    w = layer.weight if weight is None else weight
    bias = None if layer.skip_bias_add else layer.bias
    if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, w, bias)
    out = torch.matmul(x, w.t())
    return out if bias is None else out + bias
