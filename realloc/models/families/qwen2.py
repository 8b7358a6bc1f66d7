"""Qwen2 / Qwen2.5: LLaMA's block with biases on the q/k/v projections, and sliding-window attention per layer.

Qwen2.5 checkpoints typically use rope_theta 1e6, rms_norm_eps 1e-6 and, for the
small models, tied embeddings; all are read from config.json. Each layer attends either to the whole causal prefix
or within ``sliding_window`` tokens, as transformers' Qwen2Config decides it (:func:`layer_types`); the windowed
layers run exactly (``ModelConfig.sliding_window`` with ``full_attention_layers``, ``llama.window_mask``). Qwen3
decides its layers by the same rule.
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families.base import Family

LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(hf: Mapping[str, Any]) -> list[str]:
    """Each layer's attention as transformers' Qwen2Config / Qwen3Config (>= 4.53, 5.x) decides it: ``layer_types``
    when config.json has it; else a sliding window only where ``use_sliding_window`` is set, ``sliding_window`` is
    not null, and the layer index is at least ``max_window_layers``. So ``use_sliding_window: true`` with
    ``max_window_layers >= num_hidden_layers`` is full attention everywhere."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    window = _window_size(hf)
    first = int(hf.get("max_window_layers", 28))
    return ["sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(int(hf.get("num_hidden_layers", 0)))]


def _window_size(hf: Mapping[str, Any]) -> Any:
    # Qwen2Config: ``self.sliding_window = self.sliding_window if self.use_sliding_window else None`` (default 4096)
    return hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None


def sliding_layers(hf: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    """The refusal of a config.json whose layers transformers itself would not run (Qwen2 and Qwen3 alike), or
    None: layer types other than full / sliding attention, a list not one per layer, sliding layers without a
    window (transformers' sliding mask raises for ``sliding_window`` None, which ``use_sliding_window: false``
    makes it), or a window that is no positive number of tokens."""
    types = layer_types(hf)
    if hf.get("layer_types") is not None:
        odd = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if odd:
            return "layer_types", odd, " (full_attention or sliding_attention per layer)"
        if len(types) != int(hf.get("num_hidden_layers", len(types))):
            return ("layer_types", f"{len(types)} entries",
                    f" (one per layer: num_hidden_layers={hf['num_hidden_layers']})")
    if "sliding_attention" not in types:
        return None
    window = _window_size(hf)
    if window is None:
        return ("layer_types", "sliding_attention", " (transformers runs sliding layers only with use_sliding_window: "
                "true and a sliding_window; without them it refuses the model)")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return "sliding_window", window, " (a positive number of tokens)"
    return None


def layer_windows(hf: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(the window, the layers of full attention) of a config.json ``sliding_layers`` accepted."""
    types = layer_types(hf)
    if "sliding_attention" not in types:
        return None, ()
    return int(_window_size(hf)), tuple(i for i, t in enumerate(types) if t == "full_attention")


def layer_window_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The keys transformers decides each layer's attention by, written so that it reads back ``cfg``'s layers:
    ``layer_types`` explicitly, and ``max_window_layers`` as the leading full layers (the rule it replaces)."""
    types = ["sliding_attention" if cfg.windowed(i) else "full_attention" for i in range(cfg.n_layers)]
    lead = next((i for i, t in enumerate(types) if t != "full_attention"), cfg.n_layers)
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": lead, "layer_types": types}


FAMILY = Family(
    model_type="qwen2", causal_lm="Qwen2ForCausalLM", sequence_classification="Qwen2ForSequenceClassification",
    qkv_bias=True, defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                    "num_key_value_heads": 32},  # Qwen2Config's, not num_attention_heads
    unsupported=sliding_layers, hf_fields=layer_window_fields, windows=layer_windows, per_layer_windows=True,
)
