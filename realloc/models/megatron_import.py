"""megatron-core imported without the parts realloc never runs: import this module before any ``megatron`` import.

realloc uses megatron-core's tensor-parallel layers, mappings and RNG tracker only (``llama.py``, ``lora.py``,
``vocab_parallel.py``, ``megatron_shim.py``). Importing ``megatron.core`` also wraps its fused kernels in
``torch.compile`` at import (``megatron/core/jit.py``), which loads torch's dynamo, inductor and sympy, and imports
wandb for its dynamic inference context: 40% of the import's CPU time, paid by every worker process at start-up
(``docs/speed.md``). During that one import ``torch.compile`` leaves a function as it is (those fused functions
stay plain eager code, which realloc never calls) and ``wandb`` reads as not installed; both are restored after.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch


def _eager(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing (as a decorator with or without arguments)."""
    return fn if fn is not None else (lambda f: f)


def _import_lean() -> None:
    if "megatron.core" in sys.modules:
        return
    compile_fn = torch.compile
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError meanwhile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
    finally:
        torch.compile = compile_fn
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


_import_lean()
