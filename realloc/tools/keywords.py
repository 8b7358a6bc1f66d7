"""Runs a tool described by its signature (``declared.tool``) with the call's arguments as keywords, inside the
sandbox's child process (``child.py`` calls ``call(text)`` as it calls any tool): ``text`` is
``{"function": "module:function", "arguments": {...}}`` as JSON; a chat model's arguments given as a JSON string are
read as the object they hold; one plain string (a ``<name>...</name>`` call) goes to a function's one argument.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any


def request(function: str, arguments: Any) -> str:
    """The text ``call`` reads (``ToolEnv`` writes it)."""
    return json.dumps({"function": function, "arguments": arguments})


def call(text: str) -> Any:
    req = json.loads(text)
    module, _, attr = req["function"].partition(":")
    fn = getattr(importlib.import_module(module), attr)
    args = req["arguments"]
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            args = parsed
        else:
            params = list(inspect.signature(fn).parameters)
            if len(params) != 1:
                raise TypeError(f"{attr}() takes the arguments {', '.join(params)}: call it with a JSON object")
            args = {params[0]: args}
    if not isinstance(args, dict):
        raise TypeError(f"{attr}()'s arguments must be a JSON object, got {json.dumps(args)[:100]}")
    return fn(**args)
