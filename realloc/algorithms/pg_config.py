"""The settings of a policy-gradient loss (``PGLossConfig``), torch-free so that experiment files and the planner
import them cheaply; what each means and the loss they configure: ``pg_loss.py``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from realloc.algorithms.decoupled_config import check_decoupled
from realloc.algorithms.train_config import TrainConfig

# How a loss over tokens is normalized (losses.py); here so that settings check it without importing torch.
LOSS_NORMS = ("sequence", "token", "constant")

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("reward", "loss")


@dataclasses.dataclass(frozen=True)
class PGLossConfig(TrainConfig):
    """Loss options of a policy-gradient train step (what each does: ``pg_loss.py``)."""

    kl_coef: float = 0.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: clip_eps (symmetric)
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    kl_placement: Literal["reward", "loss"] = "reward"
    # Asynchronous RL (README): the decoupled objective (``decoupled.py``, AReaL) clips the ratio against the
    # parameters before this train step and weights it by their ratio to the generation's, capped.
    decoupled: bool = False
    behav_weight_cap: float | None = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_decoupled(name, self.decoupled, self.behav_weight_cap)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"{name}.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.kl_placement not in KL_PLACEMENTS:
            raise ValueError(f"{name}.kl_placement must be 'reward' (subtracted from the reward) or 'loss' (added to "
                             f"the loss), got {self.kl_placement!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"{name}.kl_coef must be >= 0, got {self.kl_coef!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"{name}.clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"{name}.clip_eps_high must be positive (the upper clip 1 + clip_eps_high), or None for "
                             f"clip_eps; got {self.clip_eps_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"{name}.dual_clip must be > 1 (the bound c x A on a negative advantage; 3 in Ye et al. "
                             f"2020), or None for off; got {self.dual_clip!r}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"{name}.entropy_coef must be >= 0, got {self.entropy_coef!r}")

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def kl_in_reward(self) -> float:
        """The KL coefficient applied to the reward (0 when the KL is in the loss)."""
        return self.kl_coef if self.kl_placement == "reward" else 0.0

    @property
    def kl_in_loss(self) -> float:
        """The KL coefficient applied to the loss (0 when the KL is in the reward)."""
        return self.kl_coef if self.kl_placement == "loss" else 0.0
