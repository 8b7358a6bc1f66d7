"""The keyword arguments of a call of a tool described by its signature (``declared.tool``), which the sandbox's
child passes as ``function(**arguments)``: a chat model's JSON object as it is (or a JSON string holding one); one
plain string (a ``<name>...</name>`` call, or a string argument) for a function with one argument; anything else is
an error text the policy reads as the tool's answer.
"""

from __future__ import annotations

import json
from typing import Any


def keyword_arguments(name: str, params: tuple[str, ...], raw: Any) -> dict[str, Any] | str:
    """``raw`` (a call's arguments as written) as keywords of tool ``name`` with arguments ``params``, or an error."""
    if raw in ("", None) and not params:  # a tool of no arguments, called without any
        return {}
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
        if len(params) == 1:
            return {params[0]: raw}
    if isinstance(raw, dict):
        return raw
    return f"error: {name} takes the arguments {', '.join(params) or '(none)'}: call it with a JSON object"
