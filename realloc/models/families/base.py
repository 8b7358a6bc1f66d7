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
    windowed: bool = False  # config.json's sliding_window applies to every layer (Mistral; default in ``defaults``)

    @property
    def architectures(self) -> tuple[str, str]:
        return (self.causal_lm, self.sequence_classification)

    def describe(self) -> str:
        return f"{self.model_type} ({', '.join(self.architectures)})"
