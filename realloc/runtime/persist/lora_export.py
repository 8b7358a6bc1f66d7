"""Exporting a LoRA model (``models/lora_config.py``): merged into its base, or as a PEFT adapter.

- merged (``realloc export``'s default): each adapted weight becomes ``W0 + (alpha / r) B A`` (Hu et al. 2021,
  §4.1: "we can explicitly compute and store W = W0 + BA"), in fp32 before the file's dtype, so the directory is
  a plain HF checkpoint that loads anywhere and runs at the base model's cost;
- PEFT (``--format peft``): ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's
  ``save_pretrained`` writes them for a LoRA adapter named ``default``: tensors named
  ``base_model.model.<HF name>`` with the adapter name dropped (``...q_proj.lora_A.weight``), a critic's trained
  ``score`` head as a module to save (``base_model.model.score.weight``), and the config's ``r``,
  ``lora_alpha``, ``target_modules``, ... so that ``PeftModel.from_pretrained(base, DIR)`` on the checkpoint the
  run started from gives the trained model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from realloc.atomic_file import safetensors_os_errors
from realloc.models.config import ModelConfig
from realloc.models.lora_config import base_name, is_adapter, module_prefix
from realloc.models.param_layout import param_specs

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_names(cfg: ModelConfig, base_names: list[str]) -> list[str]:
    """The adapters of the weights in ``base_names`` (their merge needs them)."""
    wanted = set(base_names)
    return [s.name for s in param_specs(cfg) if is_adapter(s.name) and base_name(s.name) in wanted]


def merge(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (base weights and their adapters, full HF tensors) with every adapter merged into its weight
    and dropped."""
    assert cfg.lora is not None
    s = cfg.lora.scaling
    out = {n: t for n, t in tensors.items() if not is_adapter(n)}
    for layer in range(cfg.n_layers):
        for m in cfg.lora.target_modules:
            p = module_prefix(layer, m)
            if p + ".weight" not in out:
                continue
            a, b = tensors[p + ".lora_A.weight"].double(), tensors[p + ".lora_B.weight"].double()
            w = out[p + ".weight"]
            out[p + ".weight"] = (w.double() + s * (b @ a)).to(w.dtype).contiguous()
    return out


def peft_config(cfg: ModelConfig, source: str | None) -> dict[str, Any]:
    """adapter_config.json of a LoRA adapter (PEFT's ``LoraConfig`` fields that this adapter sets)."""
    lora = cfg.lora
    assert lora is not None
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if cfg.is_critic else "CAUSAL_LM",
        "base_model_name_or_path": source,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": ["score"] if cfg.is_critic else None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "revision": None,
    }


def write_peft(out: Path, cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str | None) -> None:
    """The PEFT adapter directory's two files from the trained tensors (adapters and a critic's score)."""
    weights = {PEFT_PREFIX + n: t.contiguous() for n, t in tensors.items()}
    with safetensors_os_errors(out / PEFT_WEIGHTS_FILE):
        save_file(weights, str(out / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    (out / PEFT_CONFIG_FILE).write_text(json.dumps(peft_config(cfg, source), indent=2))


def trained_names(cfg: ModelConfig) -> list[str]:
    """What a PEFT adapter of ``cfg`` holds: the adapters, and a critic's score head."""
    return [s.name for s in param_specs(cfg) if is_adapter(s.name) or (cfg.is_critic and s.name == "score.weight")]
