"""Where every parameter of a model lives under a 3D-parallel layout.

This is the contract shared by the model, parameter reallocation, checkpoints
and the cost estimator: parameter names (HuggingFace LLaMA names, so checkpoints
load without renaming), full shapes, the dimension tensor parallelism splits,
and which pipeline stage holds each layer.

TP splits a weight into contiguous equal chunks along ``tp_dim``. For q/k/v
and gate/up that is the output dimension (whole heads / MLP columns per rank);
for o/down the input dimension; for the embedding and LM head the vocabulary.
Biases (Qwen2's q/k/v) split with their weight's output dimension; Qwen3's per-head q/k norms are whole on
every rank.

Replicated shards. A tensor split in whole *units* (``tp_units``: the KV heads of
k/v) cannot have more shards than units: when tp exceeds them, ``tp / units``
consecutive tp ranks hold the same unit (tp rank r holds unit ``r * units // tp``).
``shard_slices``/``shard_shape``/``shard_numel`` describe what one rank holds in
every case; ``tp_replicas`` says how many ranks hold each shard and
``is_primary`` names the one of them that counts it once (gradient norm, saving).
A tensor without ``tp_dim`` is the extreme case: one shard, held by all tp ranks.

Vocabulary padding. The embedding and LM head have ``ModelConfig.padded_vocab_size`` rows, the
last ``pad_rows`` of them zeros that HF checkpoints do not have (``config.py``): ``shape`` is what
the engine, reallocation and realloc's own checkpoints hold, ``hf_shape`` what HF files hold;
``unpad``/``pad`` convert a full tensor and ``real_rows`` says how many rows of a shard a file supplies.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from realloc.models.config import ModelConfig
from realloc.models.lora_config import COLUMN_MODULES, is_adapter, module_prefix
from realloc.strategy import even_ranges

if TYPE_CHECKING:
    import torch

EMBED_LAYER = -1  # pseudo layer index of the input embedding


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # None: replicated on every tp rank
    layer: int  # EMBED_LAYER, 0..n_layers-1 for blocks, n_layers for the head (final norm + output)
    tp_units: int | None = None  # whole units along tp_dim a shard keeps (KV heads); None: single rows/columns
    pad_rows: int = 0  # trailing zero rows along dim 0 (the vocabulary padding) that HF checkpoints lack
    zero_init: bool = False  # a (1 + w) norm (Gemma, ModelConfig.norm_plus_one): a fresh model starts it at 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape in HF checkpoints: ``shape`` without the padding rows."""
        return (self.shape[0] - self.pad_rows,) + self.shape[1:]

    @property
    def hf_numel(self) -> int:
        return self.numel // self.shape[0] * self.hf_shape[0]

    def unpad(self, full: "torch.Tensor") -> "torch.Tensor":
        """The HF tensor of a full engine tensor (a view without the padding rows)."""
        return full[: self.hf_shape[0]] if self.pad_rows else full

    def pad(self, hf: "torch.Tensor") -> "torch.Tensor":
        """The full engine tensor of an HF tensor: zero rows appended."""
        if not self.pad_rows:
            return hf
        import torch

        return torch.cat([hf, hf.new_zeros((self.pad_rows,) + tuple(hf.shape[1:]))])

    def real_rows(self, tp: int, tp_rank: int) -> int:
        """How many leading rows of tp rank ``tp_rank``'s shard exist in HF checkpoints; the rest are padding
        (all rows when ``pad_rows`` is 0; none for a shard of padding only)."""
        if not self.pad_rows:
            return self.shard_shape(tp)[0]
        lo, hi = self.shard_interval(tp, tp_rank)
        return max(0, min(hi, self.hf_shape[0]) - lo)

    def tp_replicas(self, tp: int) -> int:
        """How many tp ranks hold each shard (tp for an unsplit tensor)."""
        if self.tp_dim is None:
            return tp
        units = self.tp_units or self.shape[self.tp_dim]
        if tp <= units:
            assert units % tp == 0, (self.name, units, tp)
            return 1
        assert tp % units == 0, (self.name, units, tp)
        return tp // units

    def n_shards(self, tp: int) -> int:
        """Distinct shards over a tp group."""
        return tp // self.tp_replicas(tp)

    def is_primary(self, tp: int, tp_rank: int) -> bool:
        """Whether ``tp_rank`` is the first of the ranks holding its shard (the one that counts it once)."""
        return tp_rank % self.tp_replicas(tp) == 0

    def shard_interval(self, tp: int, tp_rank: int) -> tuple[int, int]:
        """[lo, hi) of tp rank ``tp_rank``'s shard along ``tp_dim`` ((0, 1) for an unsplit tensor)."""
        if self.tp_dim is None:
            return (0, 1)
        n = self.n_shards(tp)
        extent = self.shape[self.tp_dim]
        assert extent % n == 0, (self.name, self.shape, tp)
        size = extent // n
        k = tp_rank // self.tp_replicas(tp)
        return (k * size, (k + 1) * size)

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.shape
        lo, hi = self.shard_interval(tp, 0)
        shape = list(self.shape)
        shape[self.tp_dim] = hi - lo
        return tuple(shape)

    def shard_slices(self, tp: int, tp_rank: int) -> tuple[slice, ...]:
        """Index of tp rank ``tp_rank``'s shard inside the full tensor."""
        if self.tp_dim is None:
            return tuple(slice(None) for _ in self.shape)
        lo, hi = self.shard_interval(tp, tp_rank)
        return tuple(slice(lo, hi) if d == self.tp_dim else slice(None) for d in range(len(self.shape)))

    def shard_numel(self, tp: int) -> int:
        return self.numel // self.n_shards(tp)

    def merge_shards(self, parts: "Sequence[torch.Tensor]") -> "torch.Tensor":
        """The full tensor from the shards of tp ranks 0..tp-1 (each replicated shard taken once)."""
        tp = len(parts)
        if self.tp_dim is None:
            return parts[0]
        import torch

        return torch.cat([p for r, p in enumerate(parts) if self.is_primary(tp, r)], dim=self.tp_dim)


def _block_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    h, q, kv, inter, n_kv = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.n_kv_heads
    p = f"model.layers.{i}."
    attn = []
    # q heads split freely; k/v keep whole KV heads, replicated when tp exceeds them.
    for proj, rows, units in (("q_proj", q, None), ("k_proj", kv, n_kv), ("v_proj", kv, n_kv)):
        attn.append(ParamSpec(f"{p}self_attn.{proj}.weight", (rows, h), 0, i, units))
        if cfg.qkv_bias:
            attn.append(ParamSpec(f"{p}self_attn.{proj}.bias", (rows,), 0, i, units))
    if cfg.qk_norm:
        # Qwen3's per-head norms: one head_dim-wide weight shared by every head, so every tp rank holds it whole
        # (its gradient is a partial sum over the rank's heads: ``grads.sync_head_norms``)
        # (Gemma 3's scale by 1 + w and start at 0, like its other norms)
        attn += [ParamSpec(f"{p}self_attn.{n}.weight", (cfg.head_dim,), None, i, zero_init=cfg.norm_plus_one)
                 for n in ("q_norm", "k_norm")]
    plus_one = cfg.norm_plus_one
    base = [
        ParamSpec(p + "input_layernorm.weight", (h,), None, i, zero_init=plus_one),
        *attn,
        ParamSpec(p + "self_attn.o_proj.weight", (h, q), 1, i),
        ParamSpec(p + "post_attention_layernorm.weight", (h,), None, i, zero_init=plus_one),
        ParamSpec(p + "mlp.gate_proj.weight", (inter, h), 0, i),
        ParamSpec(p + "mlp.up_proj.weight", (inter, h), 0, i),
        ParamSpec(p + "mlp.down_proj.weight", (h, inter), 1, i),
    ]
    if cfg.sandwich_norms:  # Gemma 3's norms around the MLP
        base += [ParamSpec(p + f"{n}_feedforward_layernorm.weight", (h,), None, i, zero_init=plus_one)
                 for n in ("pre", "post")]
    return base + _adapter_specs(cfg, i, {s.name: s for s in base})


def _adapter_specs(cfg: ModelConfig, i: int, base: dict[str, ParamSpec]) -> list[ParamSpec]:
    """LoRA's A [r, in] and B [out, r] of each target linear of block ``i`` (``lora_config.py``): a column-parallel
    base keeps A whole and splits B's output rows like its own (whole KV heads for k/v); a row-parallel base
    splits A's input columns like its own and keeps B whole."""
    if cfg.lora is None:
        return []
    r, out = cfg.lora.rank, []
    for m in cfg.lora.target_modules:
        w = base[module_prefix(i, m) + ".weight"]
        n_out, n_in = w.shape
        a, b = module_prefix(i, m) + ".lora_A.weight", module_prefix(i, m) + ".lora_B.weight"
        if m in COLUMN_MODULES:
            out += [ParamSpec(a, (r, n_in), None, i), ParamSpec(b, (n_out, r), 0, i, w.tp_units)]
        else:
            out += [ParamSpec(a, (r, n_in), 1, i), ParamSpec(b, (n_out, r), None, i)]
    return out


def is_trained(cfg: ModelConfig, spec: ParamSpec) -> bool:
    """Whether a train step updates ``spec``: every parameter, or with LoRA only the adapters and a critic's
    scalar head (new for a critic or reward model, so LoRA on the trunk alone could not fit it)."""
    return cfg.lora is None or is_adapter(spec.name) or spec.name == "score.weight"


@lru_cache(maxsize=64)
def param_specs(cfg: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every parameter of the full model, in layer order."""
    L, h = cfg.n_layers, cfg.hidden_size
    vocab, pad = cfg.padded_vocab_size, cfg.vocab_padding
    specs = [ParamSpec("model.embed_tokens.weight", (vocab, h), 0, EMBED_LAYER, pad_rows=pad)]
    for i in range(L):
        specs.extend(_block_specs(cfg, i))
    specs.append(ParamSpec("model.norm.weight", (h,), None, L, zero_init=cfg.norm_plus_one))
    if cfg.is_critic:
        # Named like HF's LlamaForSequenceClassification head; too small to shard.
        specs.append(ParamSpec("score.weight", (1, h), None, L))
    elif not cfg.tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (vocab, h), 0, L, pad_rows=pad))
    return tuple(specs)


@lru_cache(maxsize=1024)  # pure; the planner asks for it once per parameter of every layout
def stage_layer_ranges(n_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Decoder blocks [lo, hi) of each pipeline stage: as even as possible, earlier stages take the remainder.

    Stage 0 also holds the embedding and the last stage the head.
    """
    if not 1 <= pp <= n_layers:
        raise ValueError(f"pp={pp} must be between 1 and the number of layers ({n_layers})")
    return even_ranges(n_layers, pp)


def stage_of_layer(n_layers: int, pp: int, layer: int) -> int:
    if layer == EMBED_LAYER:
        return 0
    if layer >= n_layers:
        return pp - 1
    for s, (lo, hi) in enumerate(stage_layer_ranges(n_layers, pp)):
        if lo <= layer < hi:
            return s
    raise AssertionError(layer)


@lru_cache(maxsize=4096)  # pure and immutable; the search prices thousands of layouts
def stage_param_specs(cfg: ModelConfig, pp: int, pp_rank: int) -> tuple[ParamSpec, ...]:
    """Parameters held by pipeline stage ``pp_rank``.

    With tied embeddings and pp > 1 the last stage holds its own replica of the
    embedding to compute logits; the model keeps the two copies in sync.
    """
    out = [s for s in param_specs(cfg) if stage_of_layer(cfg.n_layers, pp, s.layer) == pp_rank]
    if cfg.tie_embeddings and pp > 1 and pp_rank == pp - 1:
        out.append(param_specs(cfg)[0])
    return tuple(out)


def shard_numel(cfg: ModelConfig, tp: int, pp: int, pp_rank: int) -> int:
    """Elements one device of (tp, pp_rank) holds."""
    return sum(s.shard_numel(tp) for s in stage_param_specs(cfg, pp, pp_rank))


def replicated_shard_numel(cfg: ModelConfig, tp: int, pp: int, pp_rank: int) -> int:
    """Elements of split trained tensors (the k/v projections when tp exceeds the KV heads) one device of
    (tp, pp_rank) shares with other tp ranks: their gradients are summed over those ranks each step."""
    return sum(s.shard_numel(tp) for s in stage_param_specs(cfg, pp, pp_rank)
               if s.tp_dim is not None and s.tp_replicas(tp) > 1 and is_trained(cfg, s))


def trained_shard_numel(cfg: ModelConfig, tp: int, pp: int, pp_rank: int) -> int:
    """Elements one device of (tp, pp_rank) trains: ``shard_numel``, or with LoRA its adapters' shards."""
    return sum(s.shard_numel(tp) for s in stage_param_specs(cfg, pp, pp_rank) if is_trained(cfg, s))
