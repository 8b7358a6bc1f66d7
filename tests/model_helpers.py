"""Shared pieces of the model tests: tiny HF reference models and building ParallelModels on pool workers."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from realloc.models.config import ModelConfig


def tiny_hf_config(*, kv_heads: int = 2, tie: bool = False, llama3_rope: bool = False, layers: int = 4,
                   vocab: int = 128, critic: bool = False, family: str = "llama", head_dim: int | None = None,
                   **extra):
    """A tiny LLaMA, Qwen2, Qwen3 or Mistral config (Qwen2/3: rope_theta 1e6 as in Qwen2.5/3, Qwen2's q/k/v
    biases); ``head_dim`` other than hidden / heads = 16 widens the q and o projections (Qwen3's default, 128,
    is not used: its own head_dim is always given). ``extra``: more keys of the family's config class."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    rope = {"rope_type": "default", "rope_theta": 1e6 if family in ("qwen2", "qwen3") else 5000.0}
    if llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    kw = dict(num_labels=1, pad_token_id=0) if critic else {}
    if family == "gemma3_text":  # a RoPE base per layer type (global, local)
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    if head_dim is not None or family in ("qwen3", "gemma", "gemma2", "gemma3_text"):
        kw["head_dim"] = head_dim or 16
    if family == "phi3":  # Phi3Config's token ids (32000) lie outside a tiny vocabulary
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if "partial_rotary_factor" in extra:
            rope["partial_rotary_factor"] = extra.pop("partial_rotary_factor")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
           "phi3": Phi3Config, "gemma": GemmaConfig, "gemma2": Gemma2Config,
           "gemma3_text": Gemma3TextConfig}[family]
    # initializer_range 0.1 (not 0.02) gives peaked logits, so greedy decoding has clear winners
    # and cannot flip on the last bit of a reduction order.
    return cls(vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=kv_heads, rope_parameters=rope,
               tie_word_embeddings=tie, rms_norm_eps=1e-6, max_position_embeddings=256,
               initializer_range=0.1, attn_implementation="eager", **kw, **extra)


def tiny_hf_model(path: Path, seed: int = 0, family: str = "llama", **kw):
    """A random HF LLaMA, Qwen2, Qwen3 or Mistral (or its sequence-classification critic), saved as safetensors
    under ``path``."""
    import transformers

    torch.manual_seed(seed)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
              "gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}[family]
    critic_prefix = "Gemma3Text" if family == "gemma3_text" else prefix
    cls = getattr(transformers, critic_prefix + "ForSequenceClassification" if kw.get("critic") else
                  prefix + "ForCausalLM")
    model = cls(tiny_hf_config(family=family, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # HF initializes biases to zero, which would test nothing
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # ones would not show which head got which
                p.normal_(1.0, 0.3)
            elif family.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's zeros (scale 1 + 0) show little
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_token_logprobs(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs aligned with the scored token (our forward() convention), from a dense HF model."""
    logits = hf(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    out = torch.zeros(ids.shape)
    out[:, 1:] = lp * (mask[:, 1:].bool() & mask[:, :-1].bool())
    return out


def dense_nll_backward(hf, state: dict, mbs: list):
    """A copy of ``hf`` holding ``state`` after the backward of the train steps' loss (the token-mean NLL of each
    micro-batch, averaged over ``mbs``): its parameters' ``.grad`` are the dense reference gradients."""
    ref = copy.deepcopy(hf)
    ref.load_state_dict(state)
    ref.zero_grad()
    for mb in mbs:
        mask = (torch.arange(mb["input_ids"].shape[1])[None] < mb["lengths"][:, None]).long()
        tok = torch.zeros_like(mask, dtype=torch.bool)
        tok[:, 1:] = mask[:, 1:].bool() & mask[:, :-1].bool()
        (-(hf_token_logprobs(ref, mb["input_ids"], mask) * tok).sum() / tok.sum() / len(mbs)).backward()
    return ref


def build_model(ctx, cfg: ModelConfig, dp: int, tp: int, pp: int, *, hf_path: str | None = None,
                state: dict | None = None, seed: int = 1, device_ids: tuple[int, ...] | None = None,
                sequence_parallel: bool = True):
    """On a pool worker: create the layout's groups (all ranks) and the model (mesh ranks; None elsewhere)."""
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.models.hf_io import load_hf_checkpoint
    from realloc.strategy import ParallelStrategy

    layout = ModelLayout.for_model(cfg, device_ids or tuple(range(dp * tp * pp)), ParallelStrategy(dp, tp, pp))
    ctx.groups.ensure_layouts([layout])
    if ctx.rank not in layout.device_ids:
        return None
    loaded = hf_path is not None or state is not None
    model = ParallelModel(cfg, ctx.groups.model_groups(layout), init="empty" if loaded else "random", seed=seed,
                          sequence_parallel=sequence_parallel)
    if hf_path is not None:
        load_hf_checkpoint(model, hf_path)
    if state is not None:
        model.load_full_state(state)
    return model


def local_shards(model) -> dict | None:
    if model is None:
        return None
    g = model.groups
    return {"dp": g.dp_rank, "tp": g.tp_rank, "pp": g.pp_rank, "tp_size": g.tp,
            "shards": {n: p.detach().clone() for n, p in model.params().items()}}


def assemble(results: list, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors from the per-rank ``local_shards`` of dp replica 0 (checks every element is covered once)."""
    from realloc.models.param_layout import param_specs

    specs = {s.name: s for s in param_specs(cfg)}
    full = {n: torch.full(s.shape, float("nan")) for n, s in specs.items()}
    for r in results:
        if r is None or r["dp"] != 0:
            continue
        for name, shard in r["shards"].items():
            full[name][specs[name].shard_slices(r["tp_size"], r["tp"])] = shard.float()
    for name, t in full.items():
        assert not torch.isnan(t).any(), f"{name} not covered by any rank"
    return full
