"""REINFORCE++ (and its baseline variant), DAPO and GSPO: settings and interface declarations (torch-free; the
train steps are ``pg_steps.py``). Their graphs are the critic-free one (``grpo.critic_free_rpcs("dapo", ...)``):
generation, reward, reference, train step.

- REINFORCE++ (Hu et al. 2025, §3): the KL to the reference per token in the reward (``kl_coef`` x the
  ``kl_estimator``'s estimate), the sequence's reward on its last token, the return-to-go of each token as its
  advantage, normalized over the whole batch (all dp ranks, all tokens): ``(A - mean) / std``. No critic, no
  group needed. The baseline variant (``reinforce_pp_baseline_actor``) first subtracts the mean reward of the
  prompt's group from each response's reward (``n_samples`` >= 2).
- DAPO (Yu et al. 2025): GRPO's group advantages with clip-higher (``clip_eps`` 0.2 below, ``clip_eps_high`` 0.28
  above), a token-level loss (``loss_norm="token"``), no KL (``kl_coef`` 0), overlong reward shaping (``overlong_buffer``
  tokens before ``gen_len``: a linear penalty down to ``-overlong_penalty``, eq. 13; with ``overlong_filter`` also
  truncated responses -- no EOS by ``gen_len`` -- left out of the loss, §3.4) and dynamic sampling: groups whose
  rewards are all equal carry no gradient and are dropped, the train batch being refilled from the other prompts
  of the generation batch. The experiment's ``batch_size`` is the generation batch (prompts sampled per
  iteration); ``train_prompts`` is the train batch, the first ``train_prompts`` groups with unequal rewards (as
  verl's gen_batch_size and train_batch_size). The estimator prices generation, reward and reference over the
  generation batch and the train step over the train batch, so oversampling costs what it costs.
- GSPO (Zheng et al. 2025): GRPO's group advantages, one importance ratio per response, the geometric mean of its
  tokens' ratios ``exp(mean_t log(pi / pi_old))``, clipped at the sequence level (``clip_eps`` 3e-4, ``clip_eps_high``
  4e-4, §5.1), a response's loss weighted as a whole (``loss_norm="sequence"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from realloc.algorithms.critic_free.grpo import PG_INPUTS, CriticFreeConfig, _actor
from realloc.algorithms.interface import Interface


@dataclasses.dataclass(frozen=True)
class ReinforcePPConfig(CriticFreeConfig):
    kl_coef: float = 0.01
    gamma: float = 1.0  # discount of the return-to-go (1: every token gets the whole reward)
    loss_norm: Literal["sequence", "token", "constant"] = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"{type(self).__name__}.gamma must be in (0, 1], got {self.gamma!r}")


@dataclasses.dataclass(frozen=True)
class DAPOConfig(CriticFreeConfig):
    kl_coef: float = 0.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = 0.28
    loss_norm: Literal["sequence", "token", "constant"] = "token"
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_placement: Literal["reward", "loss"] = "loss"
    dynamic_sampling: bool = True
    # Groups per train batch; None: the whole generation batch (dropped groups then shrink it, nothing refills).
    train_prompts: int | None = None
    overlong_buffer: int = 0  # L_cache: the last tokens before gen_len where the length penalty ramps (0: off)
    overlong_penalty: float = 1.0  # the penalty at gen_len
    # Overlong filtering (§3.4): responses that generation cut off at gen_len (no EOS) are left out of the loss.
    overlong_filter: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.train_prompts is not None and (not isinstance(self.train_prompts, int)
                                               or isinstance(self.train_prompts, bool) or self.train_prompts < 1):
            raise ValueError(f"{name}.train_prompts must be a positive integer (groups per train batch) or None for "
                             f"the whole generation batch, got {self.train_prompts!r}")
        if self.train_prompts is not None and not self.dynamic_sampling:
            raise ValueError(f"{name}.train_prompts picks the groups that dynamic sampling keeps; with "
                             f"dynamic_sampling=False leave it None (the whole batch trains)")
        if not isinstance(self.overlong_buffer, int) or isinstance(self.overlong_buffer, bool) or self.overlong_buffer < 0:
            raise ValueError(f"{name}.overlong_buffer must be a number of tokens >= 0 (0: no length penalty), got "
                             f"{self.overlong_buffer!r}")
        if not self.overlong_penalty >= 0:
            raise ValueError(f"{name}.overlong_penalty must be >= 0, got {self.overlong_penalty!r}")

    def trained_prompts(self, batch_size: int) -> int:
        """Groups the train step trains on (at most): ``train_prompts`` of the ``batch_size`` generated."""
        return batch_size if self.train_prompts is None else min(self.train_prompts, batch_size)

    def check_experiment(self, spec: Any, call: str, field: str) -> None:
        """What the settings need of the experiment (``graph/contracts.py`` asks before anything runs)."""
        if self.train_prompts is not None and self.train_prompts > spec.batch_size:
            raise ValueError(f"call {call!r}: {field}.train_prompts={self.train_prompts} exceeds the experiment's "
                             f"batch_size={spec.batch_size} (the prompts generated per iteration, from which dynamic "
                             f"sampling refills the train batch); raise batch_size or lower train_prompts")
        if self.overlong_buffer >= spec.gen_len:
            raise ValueError(f"call {call!r}: {field}.overlong_buffer={self.overlong_buffer} must be below gen_len="
                             f"{spec.gen_len} (the penalty ramps over the last overlong_buffer tokens)")


@dataclasses.dataclass(frozen=True)
class GSPOConfig(CriticFreeConfig):
    kl_coef: float = 0.0
    clip_eps: float = 3e-4
    clip_eps_high: float | None = 4e-4
    loss_norm: Literal["sequence", "token", "constant"] = "sequence"
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_placement: Literal["reward", "loss"] = "loss"
    # GSPO-token (pg_loss.py): the sequence ratio with a surrogate and gradient per token; with GSPO's group
    # advantages (constant over a response) it trains exactly as GSPO.
    token_level: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.token_level, bool):
            raise ValueError(f"GSPOConfig.token_level must be True or False, got {self.token_level!r}")


_STEPS = "pg_steps"
INTERFACES: tuple[Interface, ...] = (
    *_actor("reinforce_pp_actor", "reinforce_pp", ReinforcePPConfig, "reinforce_pp_train", PG_INPUTS, module=_STEPS),
    *_actor("reinforce_pp_baseline_actor", "reinforce_pp", ReinforcePPConfig, "reinforce_pp_baseline_train", PG_INPUTS,
            min_group_size=2, module=_STEPS),
    # A group of one has no baseline (its advantage would be 0): as GRPO, at least 2.
    *_actor("dapo_actor", "dapo", DAPOConfig, "dapo_train", PG_INPUTS, min_group_size=2, module=_STEPS),
    *_actor("gspo_actor", "gspo", GSPOConfig, "gspo_train", PG_INPUTS, min_group_size=2, module=_STEPS),
)
