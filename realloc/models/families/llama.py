"""LLaMA (LLaMA-2, LLaMA-3.x, CodeLlama, ...): the parallel model as it is, without biases."""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    # attention_bias adds biases to q, k, v and o; the parallel model has q/k/v biases only (Qwen2's).
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            return flag, hf[flag], " (LLaMA projections without bias)"
    return None


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


FAMILY = Family(
    model_type="llama", causal_lm="LlamaForCausalLM", sequence_classification="LlamaForSequenceClassification",
    qkv_bias=False, defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    unsupported=_unsupported, hf_fields=_hf_fields,
)
