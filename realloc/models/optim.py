"""AdamW with fp32 master weights for models held in bf16.

A bf16 parameter cannot absorb an update smaller than its rounding step (~0.4% of
its value), so small learning rates would silently stop training. As in mixed-
precision training (Megatron's "main params"), the optimizer keeps an fp32 copy of
every local shard and steps on it with fp32 gradients; the bf16 parameters are
rewritten from the copies after each step. The copies and the Adam moments are
optimizer state: per rank, tied to the training layout, never reallocated.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from realloc.models.loss_scale import DynamicLossScale

GRAD_DTYPES = (torch.float32, torch.bfloat16)  # the main_grad buffers a bf16 model may train with


def step_each(inner: torch.optim.Optimizer, pairs: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """``inner.step()`` once per (fp32 tensor, gradient) pair, the gradient converted to fp32 just before
    and dropped after, so that low-precision gradients never exist as an fp32 copy of all of them at
    once, only of the tensor being stepped. With ``foreach=False`` AdamW updates each tensor on its own
    (state per tensor, the tensors without a gradient skipped), so this is the one-call step exactly."""
    for p, g in pairs:
        p.grad = g.float()
        inner.step()
        p.grad = None


class MasterWeightAdamW:
    """``grad_dtype`` is the dtype of the gradients the model accumulates for it (``engine.train_step``'s
    main_grad buffers): fp32, or bf16 to save 2 bytes per parameter (each is converted to fp32 when used)."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, *,
                 grad_dtype: torch.dtype = torch.float32) -> None:
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"MasterWeightAdamW: grad_dtype must be torch.float32 or torch.bfloat16, got {grad_dtype}")
        self.grad_dtype = grad_dtype
        self.params = dict(params)
        self.loss_scale: DynamicLossScale | None = None  # fp16 models: set by make_optimizer (loss_scale.py)
        self.masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in self.params.items()}
        decay = [m for m in self.masters.values() if m.dim() >= 2]
        no_decay = [m for m in self.masters.values() if m.dim() < 2]
        # One tensor at a time: the update's fp32 temporaries are then as large as the largest shard, not as
        # all of them together (foreach's sqrt(v) of every parameter at once; estimator/memory.py)
        self.inner = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                                       foreach=False)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups, e.g. to change the learning rate."""
        return self.inner.param_groups

    @torch.no_grad()
    def step_with(self, grads: Mapping[str, torch.Tensor]) -> None:
        """One step from gradients keyed by parameter name (fp32, or bf16 converted one tensor at a time);
        then refresh the low-precision parameters."""
        if all(g.dtype == torch.float32 for g in grads.values()):
            for n, m in self.masters.items():
                m.grad = grads[n]
            self.inner.step()
        else:
            step_each(self.inner, ((m, grads[n]) for n, m in self.masters.items()))
        for n, m in self.masters.items():
            m.grad = None
            self.params[n].copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Take the parameters' current values as masters (after loading weights into the model)."""
        for n, m in self.masters.items():
            m.copy_(self.params[n])

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.inner.state_dict(), "masters": {n: m.detach().clone() for n, m in self.masters.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state["optimizer"])
        for n, m in self.masters.items():
            m.copy_(state["masters"][n])
            self.params[n].copy_(m)
