"""What one HF architecture family tells the shared config reader and writer (``families/__init__``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from realloc.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    causal_lm: str  # architecture name of the causal LM (actors, reference models)
    sequence_classification: str  # architecture name of a one-label classifier (critics, reward models)
    qkv_bias: bool  # biases on the q/k/v projections
    # Defaults of the family's transformers config class for keys a config.json may omit
    # (max_position_embeddings, rms_norm_eps, rope_theta; num_key_value_heads if not num_attention_heads;
    # head_dim if not hidden_size / num_attention_heads).
    defaults: Mapping[str, Any]
    # The first field of a config.json this family cannot run, as (field, value, why), or None.
    unsupported: Callable[[Mapping[str, Any]], "tuple[str, Any, str] | None"]
    # Keys of the family's config.json beyond the shared ones (hf_io writes both).
    hf_fields: Callable[[ModelConfig], dict[str, Any]]
    qk_norm: bool = False  # an RMSNorm over each q and k head before the rotary embedding (Qwen3)
    # (sliding window, layers of full attention) of a config.json its ``unsupported`` accepted; None: no windows.
    # Mistral and Phi-3 window every layer (``every_layer_window``); Qwen2/Qwen3 decide per layer (``layer_types``).
    windows: "Callable[[Mapping[str, Any]], tuple[int | None, tuple[int, ...]]] | None" = None
    per_layer_windows: bool = False  # config.json can say which layers are windowed (else all or none)
    # Tensors of a layer the checkpoint concatenates along their rows: (its name, the parts' names in order), both
    # relative to ``model.layers.<i>.`` (Phi-3's qkv_proj and gate_up_proj; ``models/fused_names.py``).
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    partial_rotary: bool = False  # config.json's partial_rotary_factor rotates a head's first features only (Phi-3)
    # config.json's hidden_act values the family runs, as ModelConfig.hidden_act (absent: ``defaults["hidden_act"]``,
    # else silu); Gemma's RMSNorm (1 + weight) and embedding scale
    activations: Mapping[str, str] = dataclasses.field(default_factory=lambda: {"silu": "silu"})
    norm_plus_one: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False  # Gemma 3's norms around both sublayers (ModelConfig.sandwich_norms)
    # ModelConfig fields the family reads from config.json itself, over the shared reading (Gemma 3: its RoPE
    # bases per layer type, query_pre_attn_scalar), called after ``unsupported`` accepted the config
    config_fields: "Callable[[Mapping[str, Any]], dict[str, Any]] | None" = None

    def can_write(self, cfg: ModelConfig) -> bool:
        """Whether config.json of this family can express ``cfg``'s sliding-window layers."""
        if cfg.sliding_window is None:
            return True
        return self.windows is not None and (self.per_layer_windows or not cfg.full_attention_layers)

    @property
    def architectures(self) -> tuple[str, str]:
        return (self.causal_lm, self.sequence_classification)

    def describe(self) -> str:
        return f"{self.model_type} ({', '.join(self.architectures)})"


def every_layer_window(default: int | None) -> "Callable[[Mapping[str, Any]], tuple[int | None, tuple[int, ...]]]":
    """``Family.windows`` of a family whose config.json ``sliding_window`` (``default`` when absent) binds every
    layer."""
    def windows(hf: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...]]:
        window = hf.get("sliding_window", default)
        return (None if window is None else int(window)), ()
    return windows


def window_refusal(hf: Mapping[str, Any]) -> "tuple[str, Any, str] | None":
    """A config.json ``sliding_window`` that is no positive number of tokens (nor null), as (field, value, why)."""
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        return "sliding_window", window, " (a positive number of tokens, or null for none)"
    return None
