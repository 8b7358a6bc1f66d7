"""The keyword arguments of a call of a tool described by its signature (``declared.tool``), which the sandbox's
child passes as ``function(**arguments)``: a chat model's JSON object as it is (or a JSON string holding one); one
plain string (a ``<name>...</name>`` call, or a string argument) for a function with one argument, or the string's
JSON value where the argument's type is not a string (``<square>5</square>`` for ``n: int``); no keywords for a
call that writes no arguments (the function's signature says which it lacks); anything else, or an argument whose
JSON type the tool's schema does not allow (``arg_check.py``), is an error text the policy reads as the tool's answer.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from realloc.tools.arg_check import argument_error, integral


def json_object(text: str) -> dict[str, Any] | None:
    """The object a string holds as JSON (OpenAI's ``"arguments": "{...}"``), or None: read alike for tools called
    with keywords and for one-string tools (``envs/chat_format.tool_input``)."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def keyword_arguments(name: str, params: tuple[str, ...] | Mapping[str, Any], raw: Any) -> dict[str, Any] | str:
    """``raw`` (a call's arguments as written; None for none) as keywords of tool ``name`` with arguments
    ``params`` (their names, or their JSON schemas by name, which the arguments' types are checked against), or an
    error."""
    names = tuple(params)
    if raw is None or (raw == "" and not names):  # no arguments written, or a tool of none called without any
        return {}
    found: dict[str, Any] | None = None
    if isinstance(raw, str):
        found = json_object(raw)
        if found is None and len(names) == 1:
            found = {names[0]: raw}
            if isinstance(params, Mapping) and argument_error(name, params, found):
                try:
                    value = {names[0]: json.loads(raw)}
                except ValueError:
                    value = None
                if value is not None and argument_error(name, params, value) is None:
                    found = value  # <square>5</square> for n: int: the text's JSON value, where it fits
    elif isinstance(raw, dict):
        found = raw
    if found is None:
        return f"error: {name} takes the arguments {', '.join(names) or '(none)'}: call it with a JSON object"
    if not isinstance(params, Mapping):
        return found
    wrong = argument_error(name, params, found)
    return integral(params, found) if wrong is None else wrong
