"""Gemma 3 text (``gemma3_text``: Gemma 3 1B, and the language model of the larger Gemma 3 checkpoints saved alone).

On top of Gemma's (1 + w) fp32 norms, sqrt(hidden) embedding scale, tanh-gelu MLP and tied embeddings
(``families/gemma.py``), Gemma3DecoderLayer has, as transformers 5 writes it:
- Qwen3-style per-head q/k RMSNorms before the rotary embedding, scaling by 1 + w (``ModelConfig.qk_norm``);
- norms around both sublayers: ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
  ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (``ModelConfig.sandwich_norms``);
- scores scaled by ``query_pre_attn_scalar ** -0.5`` (``ModelConfig.query_pre_attn_scalar``);
- sliding-window layers on a pattern: ``layer_types``, else every layer but each ``sliding_window_pattern``-th
  (default 6) windowed, the window ``sliding_window`` tokens (transformers' ``sliding_window_overlay``, as Mistral);
- the windowed layers' own RoPE base: ``rope_parameters["sliding_attention"]["rope_theta"]`` (older config.json:
  ``rope_local_base_freq``, default 1e4), the full layers' ``rope_parameters["full_attention"]`` (``rope_theta``,
  default 1e6) (``ModelConfig.local_rope_theta``).
Refused in one line: attention or final logit soft-capping (Gemma 2's; null in Gemma 3's releases), RoPE scaling
(the 4B/12B/27B language models scale their full layers' RoPE linearly by 8), biases, bidirectional attention
(EmbeddingGemma) and another activation. The multimodal ``gemma3`` model_type is refused by name.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family, window_refusal

LAYER_TYPES = ("full_attention", "sliding_attention")
_THETA = {"full_attention": 1e6, "sliding_attention": 1e4}  # Gemma3TextConfig.default_theta (global, local)


def layer_types(hf: Mapping[str, Any], pattern: int = 6) -> list[str]:
    """Each layer's attention as Gemma3TextConfig decides it: ``layer_types``, else every
    ``sliding_window_pattern``-th layer (1-based) full and the others windowed (Gemma2Config: every 2nd)."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern", pattern))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(int(hf.get("num_hidden_layers", 0)))]


def _rope_params(hf: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE parameters, from transformers 5's nested ``rope_parameters`` or the older keys."""
    nested = hf.get("rope_parameters") or {}
    out: dict[str, dict[str, Any]] = {}
    for kind, old in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
        params = dict(nested.get(kind) or {})
        if kind == "full_attention" and not nested and hf.get("rope_scaling"):
            params.update(hf["rope_scaling"])
        params.setdefault("rope_theta", hf.get(old) or _THETA[kind])
        out[kind] = params
    return out


def _unsupported(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(field) is not None:
            return field, hf[field], " (Gemma 3 runs without soft-capping: set it to null)"
    common = common_refusal(hf)
    if common is not None:
        return common
    nested = hf.get("rope_parameters")
    if nested and not set(nested) & set(LAYER_TYPES):
        return ("rope_parameters", dict(nested),
                " (Gemma 3 writes one per layer type: full_attention, sliding_attention)")
    for kind, params in _rope_params(hf).items():
        kind_type = params.get("rope_type", params.get("type", "default"))
        if kind_type not in (None, "default"):
            return f"rope_parameters.{kind}.rope_type", kind_type, " (RoPE without scaling)"
    return layer_refusal(hf, layer_types(hf))


def common_refusal(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    """What Gemma 2 and 3 both refuse: biases, bidirectional attention, another activation."""
    if hf.get("attention_bias"):
        return "attention_bias", hf["attention_bias"], " (Gemma projections without bias)"
    if hf.get("use_bidirectional_attention"):
        return "use_bidirectional_attention", True, " (causal decoders only)"
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        return "hidden_activation", act, " (Gemma's gelu_pytorch_tanh)"
    return None


def layer_refusal(hf: Mapping[str, Any], types: list[str]) -> tuple[str, Any, str] | None:
    """Layer types transformers would not run, or a window that is no positive number of tokens."""
    odd = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if odd:
        return "layer_types", odd, " (full_attention or sliding_attention per layer)"
    if len(types) != int(hf.get("num_hidden_layers", len(types))):
        return "layer_types", f"{len(types)} entries", f" (one per layer: num_hidden_layers={hf['num_hidden_layers']})"
    if "sliding_attention" in types:
        if hf.get("sliding_window", 4096) is None:
            return "sliding_window", None, " (sliding_attention layers need a window)"
        return window_refusal(hf)
    return None


def windows(types: list[str], hf: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(the window, the full-attention layers) of ``types`` that ``layer_refusal`` accepted."""
    if "sliding_attention" not in types:
        return None, ()
    return int(hf.get("sliding_window", 4096)), tuple(i for i, t in enumerate(types) if t == "full_attention")


def _windows(hf: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    return windows(layer_types(hf), hf)


def _config_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    rope = _rope_params(hf)
    return {"rope_theta": float(rope["full_attention"]["rope_theta"]),
            "local_rope_theta": float(rope["sliding_attention"]["rope_theta"]),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256))}


def common_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys Gemma 2 and 3 share: activation, attention scale, windows per layer, soft-capping."""
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    return {"attention_bias": False, "hidden_activation": cfg.hidden_act,
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if cfg.windowed(i) else "full_attention" for i in range(cfg.n_layers)],
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping}


def _hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    local = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
    return {**common_fields(cfg),
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}},
            "rope_local_base_freq": local, "rope_scaling": None}


FAMILY = Family(
    model_type="gemma3_text", causal_lm="Gemma3ForCausalLM",
    sequence_classification="Gemma3TextForSequenceClassification",
    qkv_bias=False, qk_norm=True, norm_plus_one=True, embed_scale=True, sandwich_norms=True,
    activations={"gelu_pytorch_tanh": "gelu_pytorch_tanh"},
    defaults={"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "head_dim": 256,
              "num_key_value_heads": 4, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    unsupported=_unsupported, hf_fields=_hf_fields, windows=_windows, per_layer_windows=True,
    config_fields=_config_fields,
)
