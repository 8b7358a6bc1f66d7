"""Tokenizers and datasets: prompts (text, chat or token ids), SFT pairs and preference pairs, in the
runtime's token layout.

``DataConfig`` is torch-free, for experiment files; ``Tokenizer`` (transformers) and the datasets (torch)
load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from realloc.data.config import DataConfig

if TYPE_CHECKING:
    from realloc.data.pairs import PreferenceDataset, SFTDataset
    from realloc.data.prompts import LoadStats, PromptDataset
    from realloc.data.tokenizer import Tokenizer

__all__ = ["DataConfig", "LoadStats", "PreferenceDataset", "PromptDataset", "SFTDataset", "Tokenizer"]


def __getattr__(name: str):
    if name in ("LoadStats", "PromptDataset"):
        from realloc.data import prompts

        return getattr(prompts, name)
    if name in ("SFTDataset", "PreferenceDataset"):
        from realloc.data import pairs

        return getattr(pairs, name)
    if name == "Tokenizer":
        from realloc.data.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'realloc.data' has no attribute {name!r}")
