"""Settings every RL or fine-tuning algorithm shares: sampling, the optimizer and its learning-rate schedule.

Torch-free, so experiment files and the planner can import it cheaply. Each algorithm's config
(``PPOConfig``, ``GRPOConfig``, ...) extends :class:`TrainConfig` with its own fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from realloc.lengths import ResponseLengths

# How a loss over tokens is normalized (losses.py); here so that settings check it without importing torch.
LOSS_NORMS = ("sequence", "token", "constant")
LR_SCHEDULES = ("constant", "linear", "cosine")
GRAD_DTYPES = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # Optimizer steps per train call (its batch split into this many): the one source of the call's
    # n_minibatches (registry.resolve_minibatches).
    n_minibatches: int = 1
    lr: float = 1e-5
    max_grad_norm: float | None = 1.0  # None: no clipping
    # AdamW's epsilon. 1e-5 (ReaLHF's default) rather than torch's 1e-8: Adam's first steps move every
    # weight by about lr whatever its gradient's size, so weights whose gradient is a near-cancelling
    # sum (relative rounding error of a percent) moved by plan-dependent amounts, and a later sampled
    # token could flip between plans. A larger epsilon damps exactly those weights.
    adam_eps: float = 1e-5
    # Generation: softmax temperature, top-k (0: off) and nucleus (1.0: off) filters.
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # Tokens every response gets before EOS may end it (capped at the experiment's gen_len): fixed-length
    # responses, e.g. to benchmark a plan at the workload the estimator prices (gen_len tokens per response).
    min_new_tokens: int = 0
    # Force response lengths to follow this distribution (realloc.models.length_schedule): each response's
    # length is drawn from the run's seed and its sequence id, and EOS comes exactly there. A seeded,
    # long-tailed workload for tests and benchmarks (docs/long-tail.md); None: the model decides.
    length_schedule: ResponseLengths | None = None
    # Partial rollouts (docs/partial-rollouts.md): a generation call gives each response at most this many
    # new tokens; a group of responses unfinished at that cut continues in the next iteration's generation
    # under the newer parameters. Needs max_staleness above the plan's staleness; None: off.
    partial_rollout_tokens: int | None = None
    # Learning-rate schedule over the run's optimizer steps (iterations x n_minibatches): a linear
    # warmup over the first warmup_proportion of the steps, then constant, or linear or cosine decay
    # to min_lr_ratio x lr at the last step.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_proportion: float = 0.0
    min_lr_ratio: float = 0.0
    # The dtype of a bf16 model's gradient accumulation buffers (``main_grad``), in which micro-batch
    # gradients accumulate and the dp reduction runs; the optimizer still steps fp32 master weights.
    # "bf16" (Megatron's grad_reduce_in_fp32=False) saves 2 bytes per parameter and halves the dp
    # traffic, at bf16 rounding of the summed gradients; fp32 models keep fp32 gradients and refuse it.
    grad_dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.n_minibatches, int) or self.n_minibatches < 1:
            raise ValueError(f"{name}.n_minibatches must be a positive integer, got {self.n_minibatches!r}")
        for field in ("lr", "adam_eps", "temperature"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be positive, got {getattr(self, field)!r}")
        for field in ("lr", "adam_eps"):  # an infinite lr makes every parameter inf or nan, an infinite eps freezes
            if not getattr(self, field) < math.inf:
                raise ValueError(f"{name}.{field} must be finite, got {getattr(self, field)!r}")
        # The clip scales gradients by max_grad_norm / norm: nan made every parameter nan, a negative value turned
        # the update around (gradient ascent), 0 froze the model; None (or inf) clips nothing.
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"{name}.max_grad_norm must be positive (None: no clipping), got {self.max_grad_norm!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"{name}.top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:  # else the first generation call, mid-run, refused it
            raise ValueError(f"{name}.top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise ValueError(f"{name}.min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        if self.length_schedule is not None and not isinstance(self.length_schedule, ResponseLengths):
            raise ValueError(f"{name}.length_schedule must be a ResponseLengths (e.g. ResponseLengths.lognormal("
                             f"median=8, p99=96)) or None, got {type(self.length_schedule).__name__}")
        if self.length_schedule is not None and self.min_new_tokens:
            raise ValueError(f"{name}: length_schedule and min_new_tokens both decide where EOS may come; set one")
        if self.partial_rollout_tokens is not None:
            _check_partial(self, name)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"{name}.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"{name}.grad_dtype must be one of {', '.join(GRAD_DTYPES)}, got {self.grad_dtype!r}")
        if not 0.0 <= self.warmup_proportion < 1.0:
            raise ValueError(f"{name}.warmup_proportion must be in [0, 1), got {self.warmup_proportion}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{name}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, base_lr: float, step: int, total_steps: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``.

        Warmup reaches ``base_lr`` at its last step ((step + 1) / W, so the first step already moves);
        the decay starts from ``base_lr`` right after it and ends at ``min_lr_ratio * base_lr`` on the
        run's last step.
        """
        warmup = round(self.warmup_proportion * total_steps)
        if step < warmup:
            return base_lr * (step + 1) / warmup
        if self.lr_schedule == "constant":
            return base_lr
        progress = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - warmup - 1)))
        low = self.min_lr_ratio * base_lr
        if self.lr_schedule == "linear":
            return low + (base_lr - low) * (1.0 - progress)
        return low + (base_lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_partial(cfg: TrainConfig, name: str) -> None:
    """partial_rollout_tokens: a positive integer, on an algorithm whose train step leaves a pending response out
    (its ``PARTIAL_ROLLOUTS``), with EOS decided by the model alone."""
    k = cfg.partial_rollout_tokens
    if type(k) is not int or k < 1:
        raise ValueError(f"{name}.partial_rollout_tokens must be a positive integer (new tokens per response per "
                         f"generation call) or None, got {k!r}")
    if not getattr(type(cfg), "PARTIAL_ROLLOUTS", False):
        raise ValueError(f"{name}.partial_rollout_tokens: partial rollouts need a train step that leaves pending "
                         f"responses out through the loss mask (GRPO, RLOO); {name} has none, so set it to None")
    if cfg.length_schedule is not None or cfg.min_new_tokens:
        raise ValueError(f"{name}.partial_rollout_tokens cannot be combined with length_schedule or min_new_tokens "
                         f"(both fix where EOS may come, and a continued response restarts its count); set one")
