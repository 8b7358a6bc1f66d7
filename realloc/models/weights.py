"""Deterministic, layout-independent initial weights.

Every parameter's full tensor is drawn from a generator seeded by (seed, parameter
name) and the local shard is sliced out of it, so the same seed gives the same
full model under every (dp, tp, pp) layout. That is what lets tests compare
layouts and lets a reallocated model be checked against a fresh one.

Drawing the full tensor costs one full-size temporary per parameter on every
rank; that is fine for random init (real models load checkpoints through
``hf_io``, which reads only the local slices).
"""

from __future__ import annotations

import hashlib

import torch

from realloc.models.config import ModelConfig
from realloc.models.param_layout import ParamSpec

INIT_STD = 0.02  # HF LlamaConfig.initializer_range


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python versions."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full_tensor(spec: ParamSpec, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (unsharded) initial value of ``spec``: ones for norms (zeros for Gemma's (1 + w) norms, as
    transformers' GemmaPreTrainedModel starts them: scale 1 either way), zeros for biases, N(0, 0.02) for matrices,
    and zeros for the vocabulary padding rows (drawn after the real rows, which are thus what they would be
    without padding). LoRA: A uniform in +-1/sqrt(in) (PEFT's kaiming_uniform_(a=sqrt(5)) bound), B zeros, so
    the adapted model starts as the base (Hu et al. 2021, §4.1)."""
    if spec.zero_init or spec.name.endswith(".bias") or spec.name.endswith(".lora_B.weight"):
        return torch.zeros(spec.shape, dtype=dtype)
    if len(spec.shape) == 1:
        return torch.ones(spec.shape, dtype=dtype)
    gen = torch.Generator().manual_seed(param_seed(seed, spec.name))
    full = torch.empty(spec.hf_shape, dtype=torch.float32)
    if spec.name.endswith(".lora_A.weight"):
        bound = 1.0 / spec.shape[1] ** 0.5
        return full.uniform_(-bound, bound, generator=gen).to(dtype)
    full.normal_(0.0, INIT_STD, generator=gen)
    return spec.pad(full.to(dtype))


def init_shard(spec: ParamSpec, seed: int, tp: int, tp_rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return init_full_tensor(spec, seed, dtype)[spec.shard_slices(tp, tp_rank)].contiguous()


def full_state_dict(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The whole model's initial tensors by HF name, as the engine holds them (vocabulary padding included;
    ``ParamSpec.unpad`` gives the HF tensor): a dense reference for tests and tools."""
    from realloc.models.param_layout import param_specs

    return {s.name: init_full_tensor(s, seed, dtype) for s in param_specs(cfg)}
