"""Tools of tests/test_leftovers2.py, imported by name in the sandbox's child."""

from __future__ import annotations


def a_dict(text: str) -> dict:
    return {"city": text, "n": [1, 2.5, None, True]}


def a_set_inside(text: str) -> dict:
    return {"s": {7}}
