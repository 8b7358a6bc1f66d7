"""PPO hyperparameters and the standard PPO dataflow (realhf.txt Figure 4).

Torch-free, so experiment files and the planner can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    n_minibatches: int = 8
    lr: float = 1e-5
    critic_lr: float = 5e-6
    kl_coef: float = 0.1
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    gamma: float = 1.0
    gae_lambda: float = 0.95
    max_grad_norm: float = 1.0
    # AdamW's epsilon. 1e-5 (ReaLHF's default) rather than torch's 1e-8: Adam's first steps move every
    # weight by about lr whatever its gradient's size, so weights whose gradient is a near-cancelling
    # sum (relative rounding error of a percent) moved by plan-dependent amounts, and a later sampled
    # token could flip between plans. A larger epsilon damps exactly those weights.
    adam_eps: float = 1e-5
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # Learning-rate schedule over the run's optimizer steps (iterations x n_minibatches), the same for
    # actor (lr) and critic (critic_lr): a linear warmup over the first warmup_proportion of the steps,
    # then constant, or linear or cosine decay to min_lr_ratio x lr at the last step.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_proportion: float = 0.0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"PPOConfig.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0.0 <= self.warmup_proportion < 1.0:
            raise ValueError(f"PPOConfig.warmup_proportion must be in [0, 1), got {self.warmup_proportion}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"PPOConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

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


LR_SCHEDULES = ("constant", "linear", "cosine")


def ppo_rpcs(actor: str | None = None, critic: str | None = None, reward: str | None = None,
             ref: str | None = None, n_minibatches: int = 8, reward_impl: str = "reward",
             reward_args: dict | None = None) -> list[ModelFunctionCallDef]:
    """The six calls of PPO: generation, three inferences and two train steps, on models named
    actor, reward, ref and critic.

    The arguments are model types. ``reward`` and ``ref`` default to the critic's and the actor's.
    Leave a type out (None) for a model that comes from a checkpoint in the experiment's ``models``.
    """
    inputs = ["seq", "logp", "ref_logp", "rewards", "values"]
    return [
        ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type=actor, interface_type=GENERATE,
                             interface_impl="ppo_actor", input_data=["prompts"], output_data=["seq", "logp"]),
        ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type=reward or critic,
                             interface_type=INFERENCE, interface_impl=reward_impl, input_data=["seq"],
                             output_data=["rewards"], interface_args=reward_args or {}),
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=ref or actor, interface_type=INFERENCE,
                             interface_impl="ppo_actor", input_data=["seq"], output_data=["ref_logp"]),
        ModelFunctionCallDef(name="critic_inf", model_name="critic", model_type=critic, interface_type=INFERENCE,
                             interface_impl="ppo_critic", input_data=["seq"], output_data=["values"]),
        ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                             interface_impl="ppo_actor", input_data=inputs, n_minibatches=n_minibatches),
        ModelFunctionCallDef(name="critic_train", model_name="critic", interface_type=TRAIN_STEP,
                             interface_impl="ppo_critic", input_data=inputs, n_minibatches=n_minibatches),
    ]
