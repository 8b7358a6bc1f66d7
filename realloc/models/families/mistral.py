"""Mistral (Mistral-7B v0.1-v0.3, Mistral-Nemo, ...): LLaMA's block without biases, with a sliding window.

MistralAttention lets a token see itself and the ``sliding_window - 1`` tokens before it, in every layer
(``ModelConfig.sliding_window``; ``llama.window_mask`` narrows every attention mask by token positions). A window
of at least ``max_position_embeddings`` never binds and is read as none; v0.2, v0.3 and Nemo have none (null),
v0.1 has 4096 of 32768 positions. MistralConfig's default window is 4096 when config.json omits the key, as
transformers reads it.
"""

from __future__ import annotations

from typing import Any

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family, every_layer_window, window_refusal


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window}


FAMILY = Family(
    model_type="mistral", causal_lm="MistralForCausalLM", sequence_classification="MistralForSequenceClassification",
    qkv_bias=False, windows=every_layer_window(4096),
    defaults={"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "num_key_value_heads": 8, "sliding_window": 4096},  # MistralConfig's
    unsupported=window_refusal, hf_fields=_hf_fields,
)
