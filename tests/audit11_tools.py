"""Declared tools of tests/test_audit_round11.py (the sandbox's child imports them by name)."""

from __future__ import annotations

from typing import Literal, Optional


def now() -> str:
    """The time.
    """
    return "noon"


def add(x: int, y: int) -> int:
    """Add.

    Args:
        x: first
        y: second
    """
    return x + y


def boom(city: str) -> str:
    """Explodes.

    Args:
        city: a city
    """
    raise RuntimeError("kaboom " + city)


def echo(text: str) -> str:
    """Echo.

    Args:
        text: the text
    """
    return "<" + text + ">"


def scale(x: float, unit: Literal["m", "km"], note: Optional[str] = None) -> str:
    """Scale.

    Args:
        x: a length
        unit: its unit
        note: a remark
    """
    return f"{x * (1000 if unit == 'km' else 1)} m{'' if note is None else ' ' + note}"


def square(n: int) -> int:
    """Square.

    Args:
        n: a whole number
    """
    return n * n
