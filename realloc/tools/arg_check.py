"""A declared tool's keyword arguments against the JSON schema the policy was shown (``declared.tool``).

A chat policy writes ``{"x": "2"}`` for ``add(x: int, y: int)`` as readily as ``{"x": 2}``; Python would then run
``"2" + "3"`` and answer ``"23"``, a wrong result the policy would learn from. Each argument's JSON type (and its
``enum``, a ``Literal``'s values) is checked here, before the tool runs, and a mismatch is an error answer naming
the argument. Missing and unknown arguments are left to the function's own signature (its ``TypeError`` is the
answer). Only the top level is checked: an array's items and an object's fields are the function's to check. A whole
float for an integer (``2.0``, an integer to JSON Schema) is passed as an int.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

# JSON schema type -> (what the policy reads, the test of a decoded JSON value)
_TYPES = {
    "string": ("a string", lambda v: isinstance(v, str)),
    "integer": ("an integer (JSON number without a fraction)",
                lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "boolean": ("true or false", lambda v: isinstance(v, bool)),
    "array": ("a JSON list", lambda v: isinstance(v, list)),
    "object": ("a JSON object", lambda v: isinstance(v, dict)),
    "null": ("null", lambda v: v is None),
}


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def argument_error(name: str, properties: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit tool ``name``'s ``properties`` (the schema's), as the policy's error answer, or
    None when each given argument has a type the schema allows."""
    for key, value in arguments.items():
        schema = properties.get(key)
        if not isinstance(schema, Mapping):
            continue  # unknown: the function's signature says so
        enum = schema.get("enum")
        if isinstance(enum, list) and value not in enum and not (value is None and schema.get("nullable")):
            return f"error: {name}'s argument {key} must be one of {', '.join(map(_shown, enum))}, got {_shown(value)}"
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not all(t in _TYPES for t in types):
            continue  # no type, or one this check does not know: the function decides
        if schema.get("nullable"):
            types = [*types, "null"]
        if not any(_TYPES[t][1](value) for t in types):
            if "integer" in types and isinstance(value, float) and value.is_integer():
                continue  # 2.0 is an integer to JSON Schema; ``integral`` passes it as 2
            wanted = " or ".join(_TYPES[t][0] for t in types)
            return f"error: {name}'s argument {key} must be {wanted}, got {_shown(value)}"
    return None


def integral(properties: Mapping[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` (checked) with a whole float given for an integer-only argument as an int (2.0 -> 2)."""
    def whole(key: str, value: Any) -> Any:
        schema = properties.get(key)
        types = schema.get("type") if isinstance(schema, Mapping) else None
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        if "integer" in types and "number" not in types and isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    return {k: whole(k, v) for k, v in arguments.items()}
