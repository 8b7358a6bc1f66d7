"""Phi-3 (Phi-3-mini-4k, Phi-3-medium-4k: model_type phi3 with the default RoPE): LLaMA's block with
fused projections, an optional sliding window and an optional partial rotary embedding.

Phi3Attention projects q, k and v with one ``qkv_proj`` (rows q | k | v) and Phi3MLP gate and up with one
``gate_up_proj`` (rows gate | up, ``up * silu(gate)``); realloc holds them as LLaMA's separate tp-split projections
and splits / concatenates their rows on load and save (``Family.fused``, ``models/fused_names.py``). The window of
config.json's ``sliding_window`` binds every layer (Phi-3-mini-4k: 2047 of 4096 positions), as Mistral's.
``partial_rotary_factor`` (in ``rope_parameters`` or at the top level) rotates each head's first
``int(head_dim * factor)`` features only (``ModelConfig.rotary_dim``). The 128k-context checkpoints' ``longrope``
(``su``) scaling, which Phi-3.5-mini and Phi-4-mini use too, is refused in one line, as is any rope type
transformers' Phi3Config refuses. Dropout
(``resid_pdrop``, ``attention_dropout``) is not applied: realloc trains as transformers' model in eval mode, and
Phi-3's own checkpoints set them to 0.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family, every_layer_window, window_refusal


def rope_type(hf: Mapping[str, Any]) -> Any:
    """The rope type Phi3Config reads: ``rope_scaling`` (legacy) first, else ``rope_parameters``."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return params.get("rope_type", params.get("type", "default"))


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    kind = rope_type(hf)
    if kind not in (None, "default"):
        return "rope_type", kind, (" (Phi-3 with the default RoPE: longrope/su scaling, the 128k-context checkpoints', "
                                   "is not implemented; use a 4k-context checkpoint)")
    return window_refusal(hf)


def rotary_factor(cfg: ModelConfig) -> float:
    """partial_rotary_factor that transformers turns back into ``cfg.rotary_dim`` (``int(head_dim * factor)``)."""
    if cfg.rotary_dim is None:
        return 1.0
    f = cfg.rotary_dim / cfg.head_dim
    while int(cfg.head_dim * f) < cfg.rotary_dim:  # a quotient that rounds below
        f = math.nextafter(f, 1.0)
    return f


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                "partial_rotary_factor": rotary_factor(cfg)}}


FAMILY = Family(
    model_type="phi3", causal_lm="Phi3ForCausalLM", sequence_classification="Phi3ForSequenceClassification",
    qkv_bias=False, windows=every_layer_window(None), partial_rotary=True,
    fused=(("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight")),
           ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))),
    defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},  # Phi3Config's
    unsupported=_unsupported, hf_fields=_hf_fields,
)
