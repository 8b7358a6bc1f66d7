"""Functions named in settings: the function itself, or ``"module:function"``."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def resolve_function(where: str, spec: Any, what: str) -> Callable[..., Any]:
    """A function given as itself or as ``"module:function"``; one ValueError naming ``where`` otherwise."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{where}: {what} must be a function or 'module:function', got {spec!r}")
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: cannot load {what} {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{where}: {what} {spec!r} is not a function")
    return fn
