"""Gemma (first generation: Gemma 2B / 7B, CodeGemma): LLaMA's block with three numeric differences.

GemmaRMSNorm scales by ``1 + weight`` (its weights start at zero) in fp32 and only then casts back
(``ModelConfig.norm_plus_one``); the embeddings are multiplied by sqrt(hidden_size) rounded to the model dtype
(``embed_scale``: bf16 rounds sqrt(3072) = 55.43 to 55.5, as transformers does); the MLP is ``gelu(gate) * up`` with
gelu's tanh approximation (``hidden_act: gelu_pytorch_tanh``; the legacy ``gelu`` of the official config.json files
is read as that, as GemmaConfig does). head_dim is given (256, not hidden / heads) and the embeddings are tied.
``attention_bias`` and ``use_bidirectional_attention`` (EmbeddingGemma) are refused in one line. Gemma 3's text
model is ``families/gemma3.py``; Gemma 2 (``gemma2``: logit soft-capping) and the multimodal ``gemma3`` are other
model_types and are refused by name.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    if hf.get("attention_bias"):
        return "attention_bias", hf["attention_bias"], " (Gemma projections without bias)"
    if hf.get("use_bidirectional_attention"):
        return "use_bidirectional_attention", True, " (causal decoders only)"
    return None


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "hidden_activation": cfg.hidden_act}


FAMILY = Family(
    model_type="gemma", causal_lm="GemmaForCausalLM", sequence_classification="GemmaForSequenceClassification",
    qkv_bias=False, norm_plus_one=True, embed_scale=True,
    activations={"gelu_pytorch_tanh": "gelu_pytorch_tanh", "gelu": "gelu_pytorch_tanh"},
    defaults={"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 256,
              "num_key_value_heads": 16, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    unsupported=_unsupported, hf_fields=_hf_fields,
)
