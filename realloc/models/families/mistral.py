"""Mistral (Mistral-7B v0.1-v0.3, Mistral-Nemo, Ministral 8B's dense layout...): LLaMA's block without biases.

The one difference is ``sliding_window``: MistralAttention lets a token see itself and the ``sliding_window - 1``
tokens before it, in every layer. The parallel model attends to the whole causal prefix, so it equals Mistral
exactly on every sequence of at most ``sliding_window`` tokens. realloc therefore runs a checkpoint whose window
is null (v0.2, v0.3, Nemo) or at least ``max_position_embeddings`` (no sequence the model accepts is longer),
and refuses a shorter window (v0.1: 4096 of 32768 positions) in one line naming the field: setting
``max_position_embeddings`` to the window in that config.json runs it exactly on sequences up to the window.
MistralConfig's default window is 4096 when config.json omits the key, as transformers reads it.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family

DEFAULT_WINDOW = 4096  # MistralConfig.sliding_window
DEFAULT_POSITIONS = 4096 * 32  # MistralConfig.max_position_embeddings


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    window = hf.get("sliding_window", DEFAULT_WINDOW)
    positions = int(hf.get("max_position_embeddings", DEFAULT_POSITIONS))
    if window is not None and int(window) < positions:
        named = "" if "sliding_window" in hf else " (config.json omits it: MistralConfig's default)"
        return ("sliding_window", window,
                f"{named} (sliding-window attention over {window} tokens, shorter than max_position_embeddings="
                f"{positions}: set sliding_window to null, or max_position_embeddings to at most {window} to run "
                f"sequences up to the window exactly)")
    return None


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    # A window of at least max_position_embeddings never binds: written back as null, with the same logits.
    return {"sliding_window": None}


FAMILY = Family(
    model_type="mistral", causal_lm="MistralForCausalLM", sequence_classification="MistralForSequenceClassification",
    qkv_bias=False, defaults={"max_position_embeddings": DEFAULT_POSITIONS, "rms_norm_eps": 1e-6,
                              "rope_theta": 10000.0, "num_key_value_heads": 8},  # MistralConfig's
    unsupported=_unsupported, hf_fields=_hf_fields,
)
