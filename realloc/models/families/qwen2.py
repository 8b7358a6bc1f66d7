"""Qwen2 / Qwen2.5: LLaMA's block with biases on the q/k/v projections.

Qwen2.5 checkpoints typically use rope_theta 1e6, rms_norm_eps 1e-6 and, for the
small models, tied embeddings; all are read from config.json. Sliding-window
attention (``use_sliding_window``) is not implemented, so such configs are refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    if hf.get("use_sliding_window"):
        return "use_sliding_window", hf["use_sliding_window"], " (sliding-window attention)"
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
        return "layer_types", other, " (only full_attention layers)"
    return None


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
            "layer_types": ["full_attention"] * cfg.n_layers}


FAMILY = Family(
    model_type="qwen2", causal_lm="Qwen2ForCausalLM", sequence_classification="Qwen2ForSequenceClassification",
    qkv_bias=True, defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    unsupported=_unsupported, hf_fields=_hf_fields,
)
