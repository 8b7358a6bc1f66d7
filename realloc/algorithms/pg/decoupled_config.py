"""The settings of the decoupled objective (``decoupled.py``), torch-free for the settings modules."""

from __future__ import annotations


def check_decoupled(owner: str, decoupled: object, cap: object) -> None:
    """``decoupled`` is a bool; ``behav_weight_cap`` a number >= 1 or None (no cap)."""
    if not isinstance(decoupled, bool):
        raise ValueError(f"{owner}.decoupled must be True or False, got {decoupled!r}")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0):
        raise ValueError(f"{owner}.behav_weight_cap must be a number >= 1 (or None: no cap), got {cap!r}")
