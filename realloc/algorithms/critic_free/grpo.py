"""Critic-free policy gradient with a group of responses per prompt: GRPO, RLOO and ReMax.

Settings, dataflow graphs and interface declarations (torch-free); the train step they share is
``critic_free.py``. Each differs only in the baseline that turns a response's reward into its
advantage (``losses.py``):

- GRPO (Shao et al. 2024, DeepSeekMath §4.1): the group's mean, divided by its standard deviation
  (``scale_rewards``); the KL to the reference is a k3 term of the loss, weighted by ``kl_coef``.
  ``GRPOConfig.dr_grpo()`` is Dr. GRPO (Liu et al. 2025): no std division and no per-response length
  normalization.
- RLOO (Ahmadian et al. 2024): the mean reward of the other responses to the same prompt; the KL to the
  reference is subtracted from the reward (``kl_coef`` x the response's summed log-ratio).
- ReMax (Li et al. 2023): the reward of the greedy response to the same prompt, from a second, greedy
  GENERATE call; the KL is subtracted from the reward as in RLOO.

All three take the clipped surrogate (PPO's) over the response tokens so that a batch can be split into
several optimizer steps; with one step the ratio is 1 and it is plain REINFORCE with a baseline.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from realloc.algorithms.interface import Interface
from realloc.algorithms.pg.pg_config import LOSS_NORMS, PGLossConfig
from realloc.calls import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef


@dataclasses.dataclass(frozen=True)
class CriticFreeConfig(PGLossConfig):
    """The critic-free algorithms' settings: the loss options (``PGLossConfig``: clip, dual clip, entropy bonus, KL
    estimator and placement) and the loss normalization."""

    n_minibatches: int = 1
    lr: float = 1e-6
    kl_coef: float = 0.04
    clip_eps: float = 0.2
    loss_norm: Literal["sequence", "token", "constant"] = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_norm not in LOSS_NORMS:
            raise ValueError(f"{type(self).__name__}.loss_norm must be one of {', '.join(LOSS_NORMS)}, "
                             f"got {self.loss_norm!r}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(CriticFreeConfig):
    PARTIAL_ROLLOUTS: ClassVar[bool] = True  # its train step reads loss_mask (partial_rollout_tokens)
    scale_rewards: bool = True  # divide by the group's std (False: Dr. GRPO)
    loss_norm: Literal["sequence", "token", "constant"] = "sequence"
    # GRPO's KL is Schulman's k3, in the loss (DeepSeekMath eq. 4)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_placement: Literal["reward", "loss"] = "loss"

    @classmethod
    def dr_grpo(cls, **kw: object) -> "GRPOConfig":
        """Dr. GRPO: advantages not divided by the group's std, losses not divided by each response's length."""
        return cls(**{"scale_rewards": False, "loss_norm": "constant", **kw})  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class RLOOConfig(CriticFreeConfig):
    PARTIAL_ROLLOUTS: ClassVar[bool] = True
    kl_coef: float = 0.05


@dataclasses.dataclass(frozen=True)
class ReMaxConfig(CriticFreeConfig):
    kl_coef: float = 0.05


_COMMON = "realloc.algorithms.common"


def _actor(name: str, field: str, cfg: type, train: str, train_inputs: tuple[str, ...],
           min_group_size: int = 1, module: str = "critic_free") -> tuple[Interface, ...]:
    return (Interface(name, GENERATE, f"{_COMMON}:actor_generate", inputs=("prompts",), outputs=("seq", "logp"),
                      config=field, config_type=cfg),
            Interface(name, INFERENCE, f"{_COMMON}:actor_logprobs", inputs=("seq",), outputs=("logp",),
                      config=field, config_type=cfg),
            Interface(name, TRAIN_STEP, f"realloc.algorithms.critic_free.{module}:{train}", inputs=train_inputs,
                      config=field, config_type=cfg, min_group_size=min_group_size))


PG_INPUTS = ("seq", "logp", "ref_logp:logp", "rewards")
INTERFACES: tuple[Interface, ...] = (
    # A group of one has no baseline: GRPO's advantage would be 0 (nothing learned), RLOO's undefined.
    *_actor("grpo_actor", "grpo", GRPOConfig, "grpo_train", PG_INPUTS, min_group_size=2),
    *_actor("rloo_actor", "rloo", RLOOConfig, "rloo_train", PG_INPUTS, min_group_size=2),
    *_actor("remax_actor", "remax", ReMaxConfig, "remax_train", PG_INPUTS + ("greedy_rewards:rewards",)),
    Interface("remax_greedy", GENERATE, f"{_COMMON}:actor_generate_greedy", inputs=("prompts",),
              outputs=("seq", "logp"), config="remax", config_type=ReMaxConfig),
)


def _reward_call(name: str, seq: str, out: str, reward: str | None, impl: str, args: dict | None) -> ModelFunctionCallDef:
    return ModelFunctionCallDef(name=name, model_name="reward", model_type=reward, interface_type=INFERENCE,
                                interface_impl=impl, input_data=[seq], output_data=[out], interface_args=args or {})


CRITIC_FREE = ("grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo")


def critic_free_rpcs(algorithm: Literal["grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dapo",
                                        "gspo"],
                     actor: str | None = None, reward: str | None = None,
                     ref: str | None = None, n_samples: int = 8, n_minibatches: int | None = None,
                     reward_impl: str = "reward", reward_args: dict | None = None) -> list[ModelFunctionCallDef]:
    """The calls of GRPO, RLOO, ReMax, REINFORCE++ (``reinforce_pp``, ``reinforce_pp_baseline``), DAPO or GSPO on
    models named actor, ref and reward (types None: from `models`).

    All but ReMax sample ``n_samples`` responses per prompt; ReMax samples one and adds a greedy one.
    ``n_minibatches`` None: the settings' (``grpo.n_minibatches``, ...); a number must equal theirs.
    """
    if algorithm not in CRITIC_FREE:
        raise ValueError(f"critic_free_rpcs: unknown algorithm {algorithm!r}; one of {', '.join(CRITIC_FREE)}")
    impl = f"{algorithm}_actor"
    n = 1 if algorithm == "remax" else n_samples
    rpcs = [
        ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type=actor, interface_type=GENERATE,
                             interface_impl=impl, input_data=["prompts"], output_data=["seq", "logp"], n_samples=n),
        _reward_call("rew_inf", "seq", "rewards", reward, reward_impl, reward_args),
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=ref or actor, interface_type=INFERENCE,
                             interface_impl=impl, input_data=["seq"], output_data=["ref_logp"]),
    ]
    train_inputs = ["seq", "logp", "ref_logp", "rewards"]
    if algorithm == "remax":
        rpcs += [ModelFunctionCallDef(name="actor_greedy", model_name="actor", interface_type=GENERATE,
                                      interface_impl="remax_greedy", input_data=["prompts"],
                                      output_data=["greedy_seq", "greedy_logp"]),
                 _reward_call("rew_greedy", "greedy_seq", "greedy_rewards", None, reward_impl, reward_args)]
        train_inputs.append("greedy_rewards")
    rpcs.append(ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                     interface_impl=impl, input_data=train_inputs, n_minibatches=n_minibatches))
    return rpcs
