"""The settings of the decoupled objective (``decoupled.py``), torch-free for the settings modules."""

from __future__ import annotations


# What a token whose importance weight exceeds ``behav_weight_cap`` gets (``decoupled.py``): "truncate", the
# cap itself (truncated importance sampling); "mask", weight 0 (AReaL's ``behav_imp_weight_cap``).
BEHAV_CAP_MODES = ("truncate", "mask")


def check_decoupled(owner: str, decoupled: object, cap: object, mode: object = "truncate") -> None:
    """``decoupled`` is a bool; ``behav_weight_cap`` a number >= 1 or None (no cap); ``behav_cap_mode`` one of
    ``BEHAV_CAP_MODES``."""
    if not isinstance(decoupled, bool):
        raise ValueError(f"{owner}.decoupled must be True or False, got {decoupled!r}")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0):
        raise ValueError(f"{owner}.behav_weight_cap must be a number >= 1 (or None: no cap), got {cap!r}")
    if mode not in BEHAV_CAP_MODES:
        raise ValueError(f"{owner}.behav_cap_mode must be 'truncate' (a weight above the cap becomes the cap) or "
                         f"'mask' (the token gets weight 0, as AReaL does), got {mode!r}")
