"""Gemma 2 (``gemma2``: Gemma 2 2B / 9B / 27B): Gemma 3's block without its q/k head norms, with soft-capping.

As transformers 5's Gemma2DecoderLayer: Gemma's (1 + w) fp32 norms, sqrt(hidden) embedding scale, tanh-gelu MLP and
tied embeddings; norms around both sublayers (``ModelConfig.sandwich_norms``); scores scaled by
``query_pre_attn_scalar ** -0.5``; ``layer_types``, else every other layer windowed (0, 2, 4, ...) to
``sliding_window`` tokens, all with one RoPE base. Soft-capping: attention scores become
``attn_logit_softcapping * tanh(scores / attn_logit_softcapping)`` before the mask (``llama.capped_attention``, an
explicit attention: SDPA has no cap), and the LM head's logits ``final_logit_softcapping * tanh(logits / ...)``.
Refused in one line: biases, bidirectional attention, another activation, a cap that is no positive number.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family
from realloc.models.families.gemma3 import common_fields, common_refusal, layer_refusal, layer_types, windows

CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    for field in CAPS:
        cap = hf.get(field, 1.0)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            return field, cap, " (a positive number, or null for none)"
    return common_refusal(hf) or layer_refusal(hf, layer_types(hf, pattern=2))


def _config_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    # Gemma2Config's defaults: 50 for the scores, 30 for the logits
    caps = {f: hf.get(f, d) for f, d in zip(CAPS, (50.0, 30.0))}
    return {"query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            **{f: None if v is None else float(v) for f, v in caps.items()}}


FAMILY = Family(
    model_type="gemma2", causal_lm="Gemma2ForCausalLM", sequence_classification="Gemma2ForSequenceClassification",
    qkv_bias=False, norm_plus_one=True, embed_scale=True, sandwich_norms=True,
    activations={"gelu_pytorch_tanh": "gelu_pytorch_tanh"},
    defaults={"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 256,
              "num_key_value_heads": 4, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    unsupported=_unsupported, hf_fields=common_fields, windows=lambda hf: windows(layer_types(hf, pattern=2), hf),
    per_layer_windows=True, config_fields=_config_fields,
)
