"""PPO hyperparameters and the standard PPO dataflow (realhf.txt Figure 4).

Torch-free, so experiment files and the planner can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import math

from realloc.algorithms.pg.pg_config import PGLossConfig
from realloc.algorithms.train_config import LR_SCHEDULES, TrainConfig
from realloc.calls import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef

__all__ = ["LR_SCHEDULES", "PPOConfig", "TrainConfig", "ppo_rpcs"]


@dataclasses.dataclass(frozen=True)
class PPOConfig(PGLossConfig):
    """PPO's settings: the shared ones (``TrainConfig``: lr, schedule, sampling, ...), the policy-gradient loss
    options (``PGLossConfig``: clip-higher, dual clip, entropy bonus, KL estimator and placement) and PPO's own."""

    n_minibatches: int = 8
    critic_lr: float = 5e-6
    kl_coef: float = 0.1
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    gamma: float = 1.0
    gae_lambda: float = 0.95

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        # Each ran unchecked: a negative critic_lr trained the critic away from the returns, a negative
        # value_clip_eps inverted the clamp's bounds, a gamma or lambda above 1 made GAE grow with the length.
        if not 0 < self.critic_lr < math.inf:
            raise ValueError(f"{name}.critic_lr must be positive and finite, got {self.critic_lr!r}")
        if not self.value_clip_eps > 0:
            raise ValueError(f"{name}.value_clip_eps must be positive (inf: no value clipping), got "
                             f"{self.value_clip_eps!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"{name}.gamma must be in (0, 1], got {self.gamma!r}")
        if not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"{name}.gae_lambda must be in [0, 1], got {self.gae_lambda!r}")


def ppo_rpcs(actor: str | None = None, critic: str | None = None, reward: str | None = None,
             ref: str | None = None, n_minibatches: int | None = None, reward_impl: str = "reward",
             reward_args: dict | None = None) -> list[ModelFunctionCallDef]:
    """The six calls of PPO: generation, three inferences and two train steps, on models named
    actor, reward, ref and critic.

    The arguments are model types. ``reward`` and ``ref`` default to the critic's and the actor's.
    Leave a type out (None) for a model that comes from a checkpoint in the experiment's ``models``.
    ``n_minibatches`` None: ``ppo.n_minibatches`` (``PPOConfig``'s 8 by default); a number must equal it.
    """
    return [
        ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type=actor, interface_type=GENERATE,
                             interface_impl="ppo_actor", input_data=["prompts"], output_data=["seq", "logp"]),
        ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type=reward or critic,
                             interface_type=INFERENCE, interface_impl=reward_impl, input_data=["seq"],
                             output_data=["rewards"], interface_args=reward_args or {}),
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=ref or actor, interface_type=INFERENCE,
                             interface_impl="ppo_actor", input_data=["seq"], output_data=["ref_logp"]),
        *critic_and_train_calls(critic, n_minibatches),
    ]


def critic_and_train_calls(critic: str | None, n_minibatches: int | None) -> list[ModelFunctionCallDef]:
    """PPO's critic inference and its two train steps (shared with multi-turn PPO, ``multiturn_graph.py``)."""
    inputs = ["seq", "logp", "ref_logp", "rewards", "values"]
    return [
        ModelFunctionCallDef(name="critic_inf", model_name="critic", model_type=critic, interface_type=INFERENCE,
                             interface_impl="ppo_critic", input_data=["seq"], output_data=["values"]),
        ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                             interface_impl="ppo_actor", input_data=inputs, n_minibatches=n_minibatches),
        ModelFunctionCallDef(name="critic_train", model_name="critic", interface_type=TRAIN_STEP,
                             interface_impl="ppo_critic", input_data=inputs, n_minibatches=n_minibatches),
    ]
