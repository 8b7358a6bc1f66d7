"""Tokenizers and prompt datasets: text, chat and token-id prompts in, the runtime's token layout out.

``DataConfig`` is torch-free, for experiment files; ``Tokenizer`` (transformers) and ``PromptDataset``
(torch) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from realloc.data.config import DataConfig

if TYPE_CHECKING:
    from realloc.data.prompts import LoadStats, PromptDataset
    from realloc.data.tokenizer import Tokenizer

__all__ = ["DataConfig", "LoadStats", "PromptDataset", "Tokenizer"]


def __getattr__(name: str):
    if name in ("LoadStats", "PromptDataset"):
        from realloc.data import prompts

        return getattr(prompts, name)
    if name == "Tokenizer":
        from realloc.data.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'realloc.data' has no attribute {name!r}")
