"""The settings of a policy-gradient loss (``PGLossConfig``), torch-free so that experiment files and the planner
import them cheaply; what each means and the loss they configure: ``pg_loss.py``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from realloc.algorithms.train_config import LOSS_NORMS, TrainConfig  # noqa: F401  (LOSS_NORMS: the settings' check)

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("reward", "loss")


# What a token whose importance weight exceeds ``behav_weight_cap`` gets (``decoupled.py``): "truncate", the
# cap itself (truncated importance sampling); "mask", weight 0 (AReaL's ``behav_imp_weight_cap``).
BEHAV_CAP_MODES = ("truncate", "mask")


def check_decoupled(owner: str, decoupled: object, cap: object, mode: object = "truncate") -> None:
    """The decoupled objective's settings (``decoupled.py``): ``decoupled`` is a bool; ``behav_weight_cap`` a number
    >= 1 or None (no cap); ``behav_cap_mode`` one of ``BEHAV_CAP_MODES``."""
    if not isinstance(decoupled, bool):
        raise ValueError(f"{owner}.decoupled must be True or False, got {decoupled!r}")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0):
        raise ValueError(f"{owner}.behav_weight_cap must be a number >= 1 (or None: no cap), got {cap!r}")
    if mode not in BEHAV_CAP_MODES:
        raise ValueError(f"{owner}.behav_cap_mode must be 'truncate' (a weight above the cap becomes the cap) or "
                         f"'mask' (the token gets weight 0, as AReaL does), got {mode!r}")


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
    behav_cap_mode: Literal["truncate", "mask"] = "truncate"  # above the cap: the cap, or weight 0 (AReaL)

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_decoupled(name, self.decoupled, self.behav_weight_cap, self.behav_cap_mode)
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
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            raise ValueError(f"{name}.clip_eps_high={self.clip_eps_high!r} is below clip_eps={self.clip_eps!r}: "
                             f"clip-higher widens the upper clip (DAPO §3.1), so clip_eps_high must be >= clip_eps "
                             f"(or None for clip_eps)")
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
