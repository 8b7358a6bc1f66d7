"""Qwen2 / Qwen2.5: LLaMA's block with biases on the q/k/v projections.

Qwen2.5 checkpoints typically use rope_theta 1e6, rms_norm_eps 1e-6 and, for the
small models, tied embeddings; all are read from config.json. Sliding-window
attention is not implemented: a config whose layers transformers would run with a window (``layer_types``)
is refused; ``use_sliding_window`` alone is not enough for that (see :func:`layer_types`).
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family


def layer_types(hf: Mapping[str, Any]) -> list[str]:
    """Each layer's attention as transformers' Qwen2Config (>= 4.53, 5.x) decides it: ``layer_types`` when
    config.json has it; else a sliding window only where ``use_sliding_window`` is set, ``sliding_window`` is
    not null, and the layer index is at least ``max_window_layers``. So ``use_sliding_window: true`` with
    ``max_window_layers >= num_hidden_layers`` is full attention everywhere."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    first = int(hf.get("max_window_layers", 28))
    return ["sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(int(hf.get("num_hidden_layers", 0)))]


def sliding_layers(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    """The refusal of a config.json with sliding-window layers (Qwen2 and Qwen3 decide them alike), or None."""
    sliding = [i for i, t in enumerate(layer_types(hf)) if t != "full_attention"]
    if not sliding:
        return None
    if hf.get("layer_types") is not None:
        return "layer_types", sorted(set(hf["layer_types"]) - {"full_attention"}), " (only full_attention layers)"
    return ("use_sliding_window", hf["use_sliding_window"],
            f" (sliding-window attention in layers {sliding[0]}..{sliding[-1]}: max_window_layers="
            f"{hf.get('max_window_layers', 28)} < num_hidden_layers={hf.get('num_hidden_layers')})")


def full_attention_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
            "layer_types": ["full_attention"] * cfg.n_layers}


FAMILY = Family(
    model_type="qwen2", causal_lm="Qwen2ForCausalLM", sequence_classification="Qwen2ForSequenceClassification",
    qkv_bias=True, defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                    "num_key_value_heads": 32},  # Qwen2Config's, not num_attention_heads
    unsupported=sliding_layers, hf_fields=full_attention_fields,
)
