"""Qwen3 (dense): LLaMA's block without biases, plus an RMSNorm over every q and k head before the rotary embedding.

Qwen3Attention projects, reshapes to heads, normalizes each head's head_dim-wide vector with its own
``q_norm`` / ``k_norm`` weight (eps = rms_norm_eps), and only then rotates; the parallel model does the same
(``ModelConfig.qk_norm``). head_dim is 128 when config.json omits it (Qwen3Config's default, not
hidden_size / num_attention_heads; ``"head_dim": null`` is refused, as transformers refuses it), so the q and o projections are often wider than the model (Qwen3-0.6B:
16 x 128 over 1024). Sliding-window layers run as Qwen2's (the same ``layer_types`` rule). ``attention_bias`` is
refused, which in Qwen3 adds biases to o_proj as well. Mixture-of-experts Qwen3 (``qwen3_moe``) is a
different model_type and is refused by name.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family
from realloc.models.families.qwen2 import layer_window_fields, layer_windows, sliding_layers


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    # transformers' Qwen3Config refuses null ("Field 'head_dim' expected int, got NoneType"); reading it as
    # hidden/heads, as for LLaMA, would build a model transformers cannot load
    if "head_dim" in hf and hf["head_dim"] is None:
        return "head_dim", None, (" (Qwen3Config takes an integer head_dim, as transformers checks: write the number, "
                                  "or leave the key out for Qwen3's default of 128)")
    if hf.get("attention_bias"):
        return "attention_bias", hf["attention_bias"], " (Qwen3 projections without bias)"
    return sliding_layers(hf)


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, **layer_window_fields(cfg)}


FAMILY = Family(
    model_type="qwen3", causal_lm="Qwen3ForCausalLM", sequence_classification="Qwen3ForSequenceClassification",
    qkv_bias=False, qk_norm=True,
    defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "num_key_value_heads": 32, "head_dim": 128},  # Qwen3Config's
    unsupported=_unsupported, hf_fields=_hf_fields, windows=layer_windows, per_layer_windows=True,
)
