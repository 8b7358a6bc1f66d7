"""One pipeline stage of a decoder-only LLaMA on megatron-core tensor-parallel layers.

The architecture is HuggingFace's LlamaForCausalLM (RMSNorm, rotary position
embedding with the rotate-half convention, SwiGLU MLP, grouped-query attention,
optionally tied input/output embeddings), or LlamaForSequenceClassification-style
with a scalar ``score`` head for critics and reward models.

A :class:`LlamaStage` holds exactly the parameters ``param_layout.stage_param_specs``
assigns to its pipeline stage, under the same (HF) names, each holding the tp
shard ``spec.shard_slices(tp, tp_rank)`` of the full tensor:

- q/k/v, gate/up: ``ColumnParallelLinear`` (output features split, whole heads per rank;
  Qwen2's q/k/v biases split with them). When tp exceeds the KV heads, each rank's k/v
  layer holds one whole KV head, shared by ``tp / n_kv_heads`` consecutive ranks
  (``param_layout`` replicated shards; ``grads`` sums their gradients),
- o/down: ``RowParallelLinear`` (input features split, all-reduce of the output),
- embedding: ``VocabParallelEmbedding``; LM head: ``ColumnParallelLinear`` over the vocabulary,
  so logits stay split over the vocabulary (see ``vocab_parallel``). Both have the padded vocabulary's
  rows (``ModelConfig.padded_vocab_size``); the head sets the logits of padding columns to -inf,
- norms (Qwen3's per-head q/k norms too) and the critic's ``score`` are replicated on every tp rank.

Activations are ``[batch, seq, hidden]``; under sequence parallelism (``sequence_parallel.py``, a
``TokenSplit`` passed as ``split``) the residual stream between the tp regions is the rank's ``[local, hidden]``
share of the flattened tokens, gathered before the column-parallel projections and reduce-scattered after
the row-parallel ones (the megatron layers hold the weights; ``F.linear`` applies them there).

Attention takes either ``mask=None``, meaning plain causal attention (right-padded rows need nothing more: a real token
never looks right, so padding is invisible to it; on GPUs this is the flash-attention
path), or an explicit boolean mask (True = may attend) for packed sequences and
left-padded generation with a KV cache.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
import realloc.models.megatron_import  # noqa: F401  (first: megatron-core without torch.compile, wandb)
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from torch import nn

from realloc.models.config import ModelConfig, tp_error
from realloc.models.param_layout import stage_layer_ranges
from realloc.models.sequence_parallel import TokenSplit, gather_project, row_parallel
from realloc.models.tp1_linear import project


def _no_init(weight: torch.Tensor) -> None:
    # Weights are written by the owner (deterministic full-tensor init or a checkpoint), never by megatron.
    return None


def megatron_config(tp: int, dtype: torch.dtype, device: torch.device) -> ModelParallelConfig:
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        sequence_parallel=False,
        gradient_accumulation_fusion=False,
    )


def _plus_one(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm scale: 1 + weight in fp32 (``GemmaRMSNorm``: ``output * (1.0 + self.weight.float())``)."""
    return weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1.0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              plus_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's forward: (weight * x / rms(x), 1 / rms(x)); ``_RMSNormFunction`` says why it computes so.
    ``plus_one`` (Gemma): ((1 + weight) * x / rms(x)) multiplied in fp32, then cast to x's dtype."""
    # fp32 as HF computes, or float64 for a float64 input (gradcheck) instead of HF's downcast
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # x itself when x is fp32
    ms = xf.pow(2).mean(-1, keepdim=True)
    rinv = ms.add_(eps).rsqrt_()  # == torch.rsqrt(ms + eps), without a second per-token tensor
    if xf is x:
        normed = xf * rinv
    else:
        normed = xf.mul_(rinv)  # the fp32 copy is ours: normalize it in place
    if plus_one:
        return normed.mul_(_plus_one(weight)).to(x.dtype), rinv
    normed = normed.to(x.dtype)
    if weight.dtype == normed.dtype:
        return normed.mul_(weight), rinv  # == weight * normed (IEEE products commute); normed is ours
    return weight * normed, rinv


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and 1/rms for the backward (issue 21, "Lean RMSNorm").

    Forward, as HF's LlamaRMSNorm: ``y = w * (x_f * r).to(x.dtype)`` with ``x_f = x.float()`` (float64 stays
    float64) and
    ``r = rsqrt(mean(x_f^2) + eps)`` per token, the same ops in the same order so that the result is the
    bit-for-bit output of the plain-torch formula. Autograd on that formula would save x_f (an fp32 copy of a
    bf16 input), r, the normalized product cast back and, in its backward, allocate five fp32 h-wide tensors.

    Backward, with ``g = dy * w`` and ``x_hat = x_f * r`` (the cast back to x.dtype passes gradients through):
        dw = sum over tokens of dy * x_hat
        dx = r * (g - x_hat * mean(g * x_hat))
    (differentiating r = (mean(x_f^2) + eps)^-1/2 gives dr/dx_f = -r^3 x_f / h). One fp32 h-wide buffer holds
    x_hat, then dy * x_hat, then dy * w * x_hat, then dx, updated in place; in fp32 it is dx itself. The weight
    gradient is reduced in fp32 from dy * x_hat, not from the rounded product the forward multiplied, which is
    at least as accurate as autograd's low-precision product.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                eps: float, plus_one: bool = False) -> torch.Tensor:
        out, rinv = _rms_norm(x, weight, eps, plus_one)
        ctx.save_for_backward(x, weight, rinv)
        ctx.plus_one = plus_one
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, rinv = ctx.saved_tensors
        # Gemma scales by 1 + weight: the same formulas with that scale (its gradient is the weight's)
        scale = _plus_one(weight) if ctx.plus_one else weight
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        buf = x.to(rinv.dtype, copy=True)  # the one fp32 h-wide temporary
        buf.mul_(rinv).mul_(dy)  # dy * x_hat
        dw = None
        if need_dw:
            dw = buf.sum(dim=tuple(range(buf.dim() - 1))).to(weight.dtype)
        if not need_dx:
            return None, dw, None, None
        # c = mean(g * x_hat) per token, then dx = r * (g - x_f * r * c) = (g - x_f * (r * c)) * r
        c = buf.mul_(scale).mean(-1, keepdim=True)
        buf.copy_(x).mul_(c.mul_(rinv).neg_()).addcmul_(dy, scale).mul_(rinv)
        return buf.to(x.dtype), dw, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one  # Gemma: scale by 1 + weight (ModelConfig.norm_plus_one)
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and scale in the input dtype, like HF, so bf16 results match it; the backward
        # keeps x and 1/rms only (_RMSNormFunction). Without autograd the same arithmetic, minus the Function.
        if not torch.is_grad_enabled():
            return _rms_norm(x, self.weight, self.eps, self.plus_one)[0]
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.plus_one)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d) of the rotary embedding, with Llama-3 frequency scaling if configured;
    d is the rotated width (``rotary_dim`` of a partial rotary embedding, else head_dim). ``local``: the
    windowed layers' own base (Gemma 3's ``local_rope_theta``, never scaled)."""
    d = cfg.rotary_dim or cfg.head_dim
    theta = cfg.local_rope_theta if local and cfg.local_rope_theta is not None else cfg.rope_theta
    # fp32 like HF, so angles agree bit for bit at long positions.
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if local:
        return inv
    scaling = cfg.rope_scaling
    if scaling is not None:
        factor, low_ff, high_ff, original_ctx = scaling
        # Llama 3.1 "llama3" scaling: long wavelengths are slowed down by `factor`,
        # short ones kept, and the band between them interpolated smoothly.
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = original_ctx / low_ff, original_ctx / high_ff
        smooth = ((original_ctx / wavelen) - low_ff) / (high_ff - low_ff)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > low_wl, inv / factor, torch.where(wavelen < high_wl, inv, mid))
    return inv


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [batch, 1, seq, head_dim] for ``position_ids`` [batch, seq] (angles in fp32)."""
    angles = position_ids.unsqueeze(-1).float() * inv_freq.to(position_ids.device)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    if d < x.shape[-1]:  # partial rotary (Phi-3's partial_rotary_factor): the features past d pass unrotated
        rot = x[..., :d]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., d:]), dim=-1)
    return x * cos + _rotate_half(x) * sin


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     cap: float) -> torch.Tensor:
    """Attention with Gemma 2's soft-capped scores, as transformers' eager path: ``cap * tanh(q k^T scale / cap)``,
    then the mask (True = may attend; None: causal), a softmax in fp32 cast back, and the values."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        t, s = q.shape[-2], k.shape[-2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


@dataclasses.dataclass
class KVCache:
    """Keys and values of one layer's local heads: [batch, local kv heads, max_len, head_dim]. With a sliding
    window (Mistral), ``pos`` [batch, max_len] holds each slot's token position (the first layer's is the one
    ``LlamaStage.run_layers`` writes and reads)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: dist.ProcessGroup, mcfg: ModelParallelConfig) -> None:
        super().__init__()
        tp = tp_group.size()
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.n_local_heads = cfg.n_heads // tp
        self.n_local_kv = cfg.local_kv_heads(tp)
        # Megatron splits output features evenly over tp: asking for n_local_kv heads per rank
        # times tp gives each rank exactly its heads, whether they are split or replicated.
        kv_out = self.n_local_kv * self.head_dim * tp
        common = dict(config=mcfg, init_method=_no_init, tp_group=tp_group)
        qkv = dict(common, bias=cfg.qkv_bias, gather_output=False, skip_bias_add=False)
        self.q_proj = ColumnParallelLinear(h, cfg.q_dim, **qkv)
        self.k_proj = ColumnParallelLinear(h, kv_out, **qkv)
        self.v_proj = ColumnParallelLinear(h, kv_out, **qkv)
        self.o_proj = RowParallelLinear(cfg.q_dim, h, input_is_parallel=True, skip_bias_add=False, bias=False,
                                        **common)
        if cfg.qk_norm:  # Qwen3: every head of q and k normalized over its head_dim before the rotary embedding
            # (Gemma 3's scale by 1 + w like its other norms)
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, mcfg.params_dtype, self.q_proj.weight.device,
                                  cfg.norm_plus_one)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, mcfg.params_dtype, self.q_proj.weight.device,
                                  cfg.norm_plus_one)
        self.qk_norm = cfg.qk_norm
        # Gemma 3 scales the scores by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5 (None: SDPA's default)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2: scores capped by tanh, outside SDPA

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, cache_start: int | torch.Tensor = 0,
                split: TokenSplit | None = None) -> torch.Tensor:
        if split is None:
            b, t, _ = x.shape
            q, k, v = (project(p, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            # sequence parallel: one all-gather of the rank's tokens feeds all three projections
            b, t = split.batch, split.seq
            q, k, v = gather_project(split, x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, t, self.n_local_heads, self.head_dim)
        k = k.view(b, t, self.n_local_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.n_local_kv, self.head_dim).transpose(1, 2)
        # One at a time: q's unrotated copy is freed before k's rotary temporaries exist (a smaller peak;
        # opcount.attention_working_bytes_per_token counts it).
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if isinstance(cache_start, torch.Tensor):
            # static-shape decoding (static_decode.py): the slot is a device tensor, so a CUDA graph replays
            # the write at whatever slot it names, and attention covers every slot under the mask
            assert cache is not None and t == 1
            cache.k.index_copy_(2, cache_start, k)
            cache.v.index_copy_(2, cache_start, v)
            k, v = cache.k, cache.v
        elif cache is not None:
            end = cache_start + t
            cache.k[:, :, cache_start:end] = k
            cache.v[:, :, cache_start:end] = v
            k, v = cache.k[:, :, :end], cache.v[:, :, :end]
        # Local q head i uses local kv head i // rep: TP keeps whole GQA groups on one rank, or
        # (KV heads replicated) the rank's q heads all belong to the group of its one KV head.
        rep = self.n_local_heads // self.n_local_kv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None and cache is not None:
            raise ValueError("attention with a KV cache needs an explicit mask (cache_mask)")
        if self.softcap is not None:
            o = capped_attention(q, k, v, mask, self.scale or self.head_dim ** -0.5, self.softcap)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        o = o.transpose(1, 2).reshape(b, t, self.n_local_heads * self.head_dim)
        return project(self.o_proj, o) if split is None else row_parallel(self.o_proj, o, split)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: dist.ProcessGroup, mcfg: ModelParallelConfig) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        common = dict(config=mcfg, init_method=_no_init, bias=False, tp_group=tp_group)
        self.gate_proj = ColumnParallelLinear(h, inter, gather_output=False, **common)
        self.up_proj = ColumnParallelLinear(h, inter, gather_output=False, **common)
        self.down_proj = RowParallelLinear(inter, h, input_is_parallel=True, skip_bias_add=False, **common)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma's; silu otherwise

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def forward(self, x: torch.Tensor, split: TokenSplit | None = None) -> torch.Tensor:
        if split is None:
            return project(self.down_proj, self.act(project(self.gate_proj, x)) * project(self.up_proj, x))
        gate, up = gather_project(split, x, (self.gate_proj, self.up_proj))  # one all-gather for both
        # without grad each input is freed once used: at most three inter/tp-wide tensors, as above
        act = self.act(gate)
        del gate
        y = act * up
        del act, up
        return row_parallel(self.down_proj, y, split)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: dist.ProcessGroup, mcfg: ModelParallelConfig,
                 device: torch.device) -> None:
        super().__init__()
        dtype = mcfg.params_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device, cfg.norm_plus_one)
        self.self_attn = Attention(cfg, tp_group, mcfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device, cfg.norm_plus_one)
        self.mlp = MLP(cfg, tp_group, mcfg)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:  # Gemma 3: post_attention_layernorm normalizes the attention's output instead
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device, cfg.norm_plus_one)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device,
                                                      cfg.norm_plus_one)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, cache_start: int | torch.Tensor = 0,
                split: TokenSplit | None = None) -> torch.Tensor:
        """``x``: ``[B, T, h]``, or with ``split`` (sequence parallelism) the rank's ``[local, h]`` tokens,
        which the norms and residual adds work on; attention and the MLP gather them."""
        # no name holds the attention's output: it is freed at the residual add, before the MLP runs
        if self.sandwich:  # Gemma3DecoderLayer: each sublayer's output normalized before its residual add
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_start, split))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), split))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_start, split)
        return x + self.mlp(self.post_attention_layernorm(x), split)


class _Trunk(nn.Module):
    """Container named ``model`` so parameter names read ``model.layers.<i>...`` like HF."""


class LlamaStage(nn.Module):
    """Pipeline stage ``pp_rank`` of ``pp`` of a LLaMA model, tensor-parallel over ``tp_group``.

    Parameters are allocated but not initialized; the owner writes them.
    """

    def __init__(self, cfg: ModelConfig, pp: int, pp_rank: int, tp_group: dist.ProcessGroup,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        tp = tp_group.size()
        err = tp_error(cfg, tp)
        if err:
            raise ValueError(f"LlamaStage of model {cfg.name!r}: {err}")
        self.cfg = cfg
        self.pp, self.pp_rank, self.tp_group = pp, pp_rank, tp_group
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == pp - 1
        self.layer_range = stage_layer_ranges(cfg.n_layers, pp)[pp_rank]
        mcfg = megatron_config(tp, dtype, device)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        if cfg.local_rope_theta is not None:  # Gemma 3's windowed layers rotate with their own base
            self.register_buffer("local_inv_freq", rope_inv_freq(cfg, local=True).to(device), persistent=False)

        self.model = _Trunk()
        # The last stage of a tied model with pp > 1 holds a replica of the embedding for its head.
        if self.is_first or (cfg.tie_embeddings and self.is_last):
            self.model.embed_tokens = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size,
                                                             init_method=_no_init, config=mcfg, tp_group=tp_group)
        lo, hi = self.layer_range
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, tp_group, mcfg, device) for i in range(lo, hi)})
        if self.is_last:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device, cfg.norm_plus_one)
            if cfg.is_critic:
                self.score = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
            else:
                self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.padded_vocab_size, config=mcfg,
                                                    init_method=_no_init, bias=False, gather_output=False,
                                                    tp_group=tp_group, skip_weight_param_allocation=cfg.tie_embeddings)
                # Columns of this rank's logits that are real tokens; the rest (vocabulary padding, on the
                # last rank(s) only) are masked in head().
                shard = cfg.padded_vocab_size // tp
                self.real_columns = min(shard, max(0, cfg.vocab_size - tp_group.rank() * shard))

    @property
    def layers(self) -> list[DecoderLayer]:
        return list(self.model.layers.values())

    def embed(self, input_ids: torch.Tensor, split: TokenSplit | None = None) -> torch.Tensor:
        """``[B, T, h]``, or with ``split`` the rank's ``[local, h]`` tokens of it."""
        assert self.is_first
        out = self.model.embed_tokens(input_ids)
        if self.cfg.embed_scale:  # Gemma: sqrt(hidden) as an fp32 scalar rounded to the model dtype, as HF's
            out = out * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=torch.float32).to(out.dtype)
        # The embedding all-reduces over tp (megatron's layer); a reduce-scatter would move half the bytes,
        # once per micro-batch on the first stage only.
        return out if split is None else split.scatter(out)

    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                   caches: list[KVCache] | None = None, cache_start: int | torch.Tensor = 0, recompute: bool = False,
                   split: TokenSplit | None = None) -> torch.Tensor:
        """The stage's decoder layers. ``recompute`` (training only) keeps just each layer's input for the
        backward and runs the layer's forward again there (full per-layer activation recomputation,
        as Megatron's ``recompute_granularity=full, method=uniform, num_layers=1``). ``split``: sequence
        parallelism (``sequence_parallel.py``); ``hidden`` is then the rank's ``[local, h]`` tokens, and so is
        what recomputation keeps. Decoding with KV caches runs without it."""
        assert split is None or caches is None, "sequence parallelism is for whole sequences, not KV-cache decoding"
        full_mask = mask
        if self.cfg.sliding_window is not None:  # the stage's windowed layers' mask; full ones keep ``full_mask``
            mask = window_mask(self.cfg.sliding_window, mask, position_ids, None if caches is None else caches[0],
                               cache_start)
        cos, sin = full_rope = rope_cos_sin(self.inv_freq, position_ids, hidden.dtype)
        local_rope = full_rope if self.cfg.local_rope_theta is None else rope_cos_sin(
            self.local_inv_freq, position_ids, hidden.dtype)
        recompute = recompute and torch.is_grad_enabled() and caches is None
        lo = self.layer_range[0]
        for i, layer in enumerate(self.layers):
            windowed = self.cfg.windowed(lo + i)
            layer_mask = mask if windowed else full_mask
            cos, sin = local_rope if windowed else full_rope
            if recompute:
                # Reentrant checkpointing: the forward runs without autograd and saves only its inputs,
                # so that the saved-tensor hooks of realloc.models.activations see exactly what is kept.
                # The model has no dropout, so no RNG state needs restoring.
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, cos, sin, layer_mask, None, 0, split,
                                                           use_reentrant=True, preserve_rng_state=False)
            else:
                hidden = layer(hidden, cos, sin, layer_mask, None if caches is None else caches[i], cache_start, split)
        return hidden

    def head(self, hidden: torch.Tensor, split: TokenSplit | None = None) -> torch.Tensor:
        """Final norm and output head: vocabulary-split logits [.., V/tp] (V padded, padding columns -inf),
        or values [..] for a critic. With ``split``, ``hidden`` is the rank's ``[local, h]`` tokens and the
        result is ``[B, T, ...]`` for all of them."""
        assert self.is_last
        x = self.model.norm(hidden)
        if self.cfg.is_critic:
            values = self.score(x).squeeze(-1)
            # the score is replicated: each rank scores its own tokens, then the tp ranks share the values
            return values if split is None else split.gather_replicated(values)
        weight = self.model.embed_tokens.weight if self.cfg.tie_embeddings else None
        if split is not None:
            (logits,) = gather_project(split, x, (self.lm_head,), weight)
        else:
            logits = project(self.lm_head, x, weight)
        if self.cfg.final_logit_softcapping is not None:  # Gemma 2: cap * tanh(logits / cap), before the padding's -inf
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if self.real_columns < logits.shape[-1]:
            # -inf before any normalizer: padding ids get probability 0 in every softmax, log-prob and sample,
            # and the fill passes them no gradient, so the padding rows of the head stay zero. In place: the
            # projection keeps its input and weight for the backward, not its output, so no copy is needed.
            logits[..., self.real_columns:] = float("-inf")
        return logits

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                caches: list[KVCache] | None = None, cache_start: int | torch.Tensor = 0, recompute: bool = False,
                split: TokenSplit | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) in; hidden states (or head output on the last
        stage) out. With ``split`` the hidden states are the rank's ``[local, h]`` tokens."""
        hidden = self.embed(inputs, split) if self.is_first else inputs
        hidden = self.run_layers(hidden, position_ids, mask, caches, cache_start, recompute, split)
        return self.head(hidden, split) if self.is_last else hidden

    def new_kv_caches(self, batch: int, max_len: int, zeroed: int | None = None) -> list[KVCache]:
        """One cache per layer, all zeros; or only slots [0, ``zeroed``) zeroed and the rest left uninitialized,
        for a caller that writes every later slot before a step reads it (eager decoding: zeroing a whole cache
        of prompt + max_new_tokens slots per call cost more than the prefill of short prompts)."""
        p = next(iter(self.parameters()))
        shape = (batch, self.cfg.local_kv_heads(self.tp_group.size()), max_len, self.cfg.head_dim)
        pos = None if self.cfg.sliding_window is None else torch.zeros((batch, max_len), dtype=torch.long,
                                                                       device=p.device)
        if zeroed is None:
            return [KVCache(torch.zeros(shape, dtype=p.dtype, device=p.device),
                            torch.zeros(shape, dtype=p.dtype, device=p.device), pos) for _ in self.layers]
        out = [KVCache(torch.empty(shape, dtype=p.dtype, device=p.device),
                       torch.empty(shape, dtype=p.dtype, device=p.device), pos) for _ in self.layers]
        for c in out:
            c.k[:, :, :zeroed].zero_()
            c.v[:, :, :zeroed].zero_()
        return out


# -- attention masks --------------------------------------------------------------------------------


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal mask within segments for a whole sequence, [batch, 1, seq, seq], True = may attend.

    ``segment_ids`` [batch, seq]: tokens of one sequence share an id >= 0; padding is -1.
    Padded positions attend to themselves only, so no softmax row is empty (their outputs are ignored).
    """
    t = segment_ids.shape[1]
    idx = torch.arange(t, device=segment_ids.device)
    causal = idx.view(1, t, 1) >= idx.view(1, 1, t)
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    valid_k = (segment_ids >= 0).unsqueeze(1)
    diag = (idx.view(t, 1) == idx.view(1, t)).unsqueeze(0)
    return ((causal & same & valid_k) | diag).unsqueeze(1)


def cache_mask(key_valid: torch.Tensor, query_start: int, n_queries: int) -> torch.Tensor:
    """Mask for queries at cache slots [query_start, query_start + n_queries) over keys in slots [0, end).

    ``key_valid`` [batch, end] marks real tokens (False for left padding). [batch, 1, n_queries, end].
    """
    end = key_valid.shape[1]
    q = torch.arange(query_start, query_start + n_queries, device=key_valid.device).view(n_queries, 1)
    k = torch.arange(end, device=key_valid.device).view(1, end)
    allowed = (k <= q).unsqueeze(0) & key_valid.unsqueeze(1)
    return (allowed | (k == q).unsqueeze(0)).unsqueeze(1)


def window_mask(window: int, mask: torch.Tensor | None, position_ids: torch.Tensor, cache: KVCache | None,
                cache_start: int | torch.Tensor) -> torch.Tensor | None:
    """``mask`` narrowed to Mistral's sliding window: a query at position p sees keys at positions > p - window
    (transformers' ``sliding_window_overlay``), by token positions, so packed segments, left padding and a
    multi-turn row's kept keys all count from their own sequence's start.

    Whole sequences (``cache`` None) compare the queries' positions with themselves; ``mask`` None (causal)
    becomes explicit first. Rows no longer than the window leave ``mask`` as it is. With a KV cache the first
    layer's ``cache.pos`` gets the new tokens' positions at their slots (as the layers write their keys there) and
    the keys' positions are read from it."""
    if cache is None:
        t = position_ids.shape[1]
        if t <= window:
            return mask  # no key is a window away from a query of its own sequence
        idx = torch.arange(t, device=position_ids.device)
        base = (idx.view(t, 1) >= idx.view(1, t)).view(1, 1, t, t) if mask is None else mask
        keys = position_ids
    else:
        assert cache.pos is not None, "a sliding window's KV cache holds positions (LlamaStage.new_kv_caches)"
        if isinstance(cache_start, torch.Tensor):  # static-shape decoding: the slot is a device tensor
            cache.pos.index_copy_(1, cache_start, position_ids)
            keys = cache.pos
        else:
            end = cache_start + position_ids.shape[1]
            cache.pos[:, cache_start:end] = position_ids
            keys = cache.pos[:, :end]
        assert mask is not None, "attention with a KV cache needs an explicit mask (cache_mask)"
        if keys.shape[1] <= window:
            return mask  # slots are at least as far apart as positions: no key is a window away
        base = mask
    near = keys.unsqueeze(-2) > (position_ids - window).unsqueeze(-1)  # [B, queries, keys] bool, no wider temporary
    return base & near.unsqueeze(1)
