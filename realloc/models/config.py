"""Model configurations of the one parallel model, the model-type registry, and the one tp rule.

The parallel model (``llama.py``) is a LLaMA-architecture decoder; ``family``
names the HF architecture it was read from or is written as (``families/``),
``qkv_bias`` adds the q/k/v projection biases of Qwen2 and ``qk_norm`` the per-head q/k RMSNorms of Qwen3.

A model type is a name such as ``llama3-8b``; appending ``-critic`` gives the
same trunk with a scalar value head instead of the vocabulary projection.
Parameter counts follow the appendix's Table 1 (realhf-appendix.txt).

Vocabulary padding. Tensor parallelism splits the embedding and the LM head over the
vocabulary, but real vocabularies (97, 32001, 50257, ...) rarely divide by 2, 4 or 8. The
engine therefore holds ``padded_vocab_size`` rows: the vocabulary rounded up to a multiple of
``vocab_multiple`` = gcd(n_heads, intermediate_size). Every tp that ``tp_error`` accepts divides
both the heads and the MLP width, hence that gcd, hence the padded size, so one full shape serves
every layout of a model (parameter reallocation moves slices of that one shape between layouts).
It depends on the config alone, is as small as it can be (fewer than ``vocab_multiple`` extra rows),
and leaves a vocabulary that already divides unchanged (every registry model; Megatron's
``make_vocab_size_divisible_by`` instead rounds to 128 x tp, for GPU GEMM alignment, which would
also make the shape depend on tp). The padding rows are zeros that no token id reaches: HF
checkpoints in and out keep ``vocab_size`` rows (``hf_io`` pads and strips), the head masks their
logits to -inf (``llama.LlamaStage.head``), so log-probs, entropies and sampling see only the real
vocabulary and the rows get zero gradient and stay zero. ``total_params`` and the other counts are
the real model's (what a user's checkpoint holds); ``allocated_params`` is what the engine holds.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Any, Iterable

from realloc.models.lora_config import LoRAConfig

CRITIC_SUFFIX = "-critic"

# A parameter-free model type: a rule-based function (e.g. a reward computed
# from token ids) that still occupies a node of the dataflow graph.
RULE_MODEL_TYPE = "rule"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    is_critic: bool = False
    # Llama-3.1 "llama3" RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None for plain RoPE. Read from HF config.json by models/hf_io.py.
    rope_scaling: tuple[float, float, float, int] | None = None
    # The HF architecture family ("llama", "qwen2", "qwen3", "mistral"; see models/families) and its structural
    # differences from LLaMA that the parallel model needs: biases on the q/k/v projections (Qwen2), and an
    # RMSNorm over each q and k head before the rotary embedding (Qwen3's q_norm / k_norm, head_dim wide).
    family: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mistral's sliding window: a token attends to itself and the window - 1 tokens before it (None: the whole
    # causal prefix; a window of at least max_position_embeddings never binds and is read as None).
    sliding_window: int | None = None
    # Layers (0-based, of the whole model) that attend to the whole causal prefix although ``sliding_window`` is set:
    # Qwen2/Qwen3's per-layer windows (config.json's ``layer_types`` / ``max_window_layers``); () with a window means
    # every layer is windowed (Mistral, Phi-3). Always () without a window.
    full_attention_layers: tuple[int, ...] = ()
    # Partial rotary embedding (Phi-3's / Phi-4-mini's ``partial_rotary_factor``): only the first ``rotary_dim`` of
    # each head's head_dim features are rotated, the rest pass unchanged (None: all of head_dim).
    rotary_dim: int | None = None
    # Gemma's differences from LLaMA's block: the MLP's activation (``silu`` or ``gelu_pytorch_tanh``, gelu's tanh
    # approximation), RMSNorms that scale by 1 + weight in fp32 before casting back, and embeddings multiplied by
    # sqrt(hidden_size) rounded to the model dtype.
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    embed_scale: bool = False
    # Gemma 3's differences on top of Gemma's: norms around both sublayers (``post_attention_layernorm`` on the
    # attention's output, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP), the
    # attention scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), and the windowed layers' own
    # RoPE base (config.json's rope_local_base_freq; None: ``rope_theta`` in every layer).
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    # Gemma 2's soft-capping: attention scores become cap * tanh(scores / cap) before the mask and softmax (an explicit
    # attention path: SDPA cannot), and the LM head's logits likewise (None: no cap).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # The checkpoint's bos/eos/pad ids as (key, value) pairs, eos an int or a tuple. Not part of the shape
    # (compare=False): carried so that a saved checkpoint reloads with them (transformers' defaults are wrong
    # for LLaMA-3 and chat models).
    special_tokens: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False)
    # HF's head_dim when it differs from hidden_size / n_heads (None: that quotient). The q and o
    # projections are then n_heads * head_dim wide rather than hidden_size (``q_dim``).
    explicit_head_dim: int | None = None
    # LoRA adapters on the block's linears (``lora_config.py``): the base is frozen, only the adapters (and a
    # critic's scalar head) train. None: a plain model, every parameter trained.
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model config {self.name!r}: {field} must be positive")
        if self.hidden_size % self.n_heads:
            raise ValueError(f"model config {self.name!r}: hidden_size must be divisible by n_heads")
        if self.explicit_head_dim == self.hidden_size // self.n_heads:
            object.__setattr__(self, "explicit_head_dim", None)  # one spelling of each shape (equality, digests)
        if self.explicit_head_dim is not None and (self.explicit_head_dim <= 0 or self.explicit_head_dim % 2):
            raise ValueError(f"model config {self.name!r}: head_dim must be a positive even number (rotary "
                             f"embeddings rotate pairs), got {self.explicit_head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model config {self.name!r}: sliding_window must be positive or None, got "
                             f"{self.sliding_window}")
        if self.sliding_window is not None and self.sliding_window >= self.max_position_embeddings:
            object.__setattr__(self, "sliding_window", None)  # never binds: one spelling (equality, digests)
        full = tuple(sorted(set(self.full_attention_layers)))
        if any(not 0 <= i < self.n_layers for i in full):
            raise ValueError(f"model config {self.name!r}: full_attention_layers must be layer indices in "
                             f"[0, {self.n_layers}), got {self.full_attention_layers}")
        if self.sliding_window is None or len(full) == self.n_layers:
            object.__setattr__(self, "sliding_window", None)  # no windowed layer: one spelling
            full = ()
        object.__setattr__(self, "full_attention_layers", full)
        if self.sliding_window is None or self.local_rope_theta == self.rope_theta:
            object.__setattr__(self, "local_rope_theta", None)  # one RoPE base for every layer: one spelling
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"model config {self.name!r}: hidden_act must be silu or gelu_pytorch_tanh, got "
                             f"{self.hidden_act!r}")
        if self.rotary_dim == self.head_dim:
            object.__setattr__(self, "rotary_dim", None)
        if self.rotary_dim is not None and not (0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"model config {self.name!r}: rotary_dim must be a positive even number below head_dim "
                             f"{self.head_dim}, got {self.rotary_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model config {self.name!r}: n_heads must be divisible by n_kv_heads")
        if self.is_critic and self.tie_embeddings:
            raise ValueError(f"model config {self.name!r}: a critic cannot tie its scalar head to the embedding")
        if self.rope_scaling is not None:
            if len(self.rope_scaling) != 4 or not self.rope_scaling[2] > self.rope_scaling[1] > 0:
                raise ValueError(f"model config {self.name!r}: rope_scaling must be (factor, low_freq_factor, "
                                 f"high_freq_factor, original_max_position_embeddings) with high > low > 0")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.n_heads

    def windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based, of the whole model) attends within ``sliding_window``."""
        return self.sliding_window is not None and layer not in self.full_attention_layers

    @property
    def q_dim(self) -> int:
        """Width of the query heads (output of q_proj, input of o_proj): hidden_size unless head_dim is explicit."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def kv_replicas(self, tp: int) -> int:
        """How many tp ranks hold each KV head: 1, or tp / n_kv_heads when tp exceeds the KV heads."""
        return max(1, tp // self.n_kv_heads)

    def local_kv_heads(self, tp: int) -> int:
        """KV heads one tp rank holds (and caches): n_kv_heads / tp, at least one (replicated)."""
        return max(1, self.n_kv_heads // tp)

    @property
    def vocab_multiple(self) -> int:
        """What the engine's vocabulary is padded to a multiple of: every legal tp divides it (module docstring)."""
        return math.gcd(self.n_heads, self.intermediate_size)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the engine's embedding and LM head: ``vocab_size`` rounded up to ``vocab_multiple``."""
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    @property
    def vocab_padding(self) -> int:
        """Zero rows the engine appends to the vocabulary (0 when tp-splittable as it is)."""
        return self.padded_vocab_size - self.vocab_size

    @property
    def output_dim(self) -> int:
        """Width of the output head: the vocabulary, or 1 for a critic."""
        return 1 if self.is_critic else self.vocab_size

    # -- parameter counts (elements, not bytes) ---------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_params(self) -> int:
        """One decoder block: q, k, v, o projections (and q/k/v biases, q/k head norms), SwiGLU MLP, two RMSNorms
        (four with Gemma 3's ``sandwich_norms``)."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + (4 if self.sandwich_norms else 2) * h

    @property
    def head_params(self) -> int:
        """Final RMSNorm plus the output projection (none if tied)."""
        proj = 0 if self.tie_embeddings else self.hidden_size * self.output_dim
        return self.hidden_size + proj

    @property
    def total_params(self) -> int:
        return self.embedding_params + self.n_layers * self.layer_params + self.head_params

    @property
    def params_without_output_embedding(self) -> int:
        """Table 1's identifier column: everything but the output projection."""
        return self.embedding_params + self.n_layers * self.layer_params + self.hidden_size

    @property
    def allocated_params(self) -> int:
        """What the engine holds: ``total_params`` plus the vocabulary padding of the embedding and, if it has
        its own, the LM head (the memory and checkpoint-size estimates use this; users see ``total_params``)."""
        padded_tables = 1 if self.is_critic or self.tie_embeddings else 2
        return self.total_params + padded_tables * self.vocab_padding * self.hidden_size + self.adapter_params

    @property
    def adapter_params(self) -> int:
        """Elements of the LoRA adapters (0 without LoRA): r x (in + out) per adapted linear."""
        if self.lora is None:
            return 0
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        shape = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        return self.n_layers * self.lora.rank * sum(sum(shape[m]) for m in self.lora.target_modules)

    @property
    def trained_params(self) -> int:
        """What a train step updates: everything, or with LoRA the adapters plus a critic's scalar head."""
        if self.lora is None:
            return self.allocated_params
        return self.adapter_params + (self.hidden_size if self.is_critic else 0)

    def with_layers(self, n_layers: int, **changes: Any) -> "ModelConfig":
        """The same blocks, ``n_layers`` of them (the profiler's and estimator's short models): the first
        ``n_layers`` layers' windows (Gemma 2/3 and Qwen's full-attention layers past them dropped)."""
        full = tuple(i for i in self.full_attention_layers if i < n_layers)
        return dataclasses.replace(self, n_layers=n_layers, full_attention_layers=full, **changes)

    def as_critic(self) -> "ModelConfig":
        return dataclasses.replace(self, name=self.name + CRITIC_SUFFIX, is_critic=True, tie_embeddings=False)


def tp_error(cfg: ModelConfig, tp: int) -> str | None:
    """Why tensor parallelism of degree ``tp`` cannot hold ``cfg``, or None if it can.

    The one rule the planner (``strategy.strategy_error``), the model (``llama.LlamaStage``),
    the reallocation planner and the profiler share. Each tp rank needs whole attention heads
    and an equal share of the MLP columns. KV heads are split when tp divides them and replicated
    when tp is a multiple of them (tp rank r then holds KV head r * n_kv_heads // tp, as inference
    engines do). The vocabulary sets no condition: the engine pads it to a multiple of every tp
    this rule accepts (``ModelConfig.padded_vocab_size``).
    """
    if tp < 1:
        return f"tp={tp} must be positive"
    if cfg.n_heads % tp:
        return f"tp={tp} must divide the {cfg.n_heads} attention heads of {cfg.name}"
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        return (f"tp={tp} must divide the {cfg.n_kv_heads} KV heads of {cfg.name} or be a multiple of them "
                f"(KV heads are then replicated)")
    if cfg.intermediate_size % tp:
        return f"tp={tp} must divide the MLP intermediate size ({cfg.intermediate_size}) of {cfg.name}"
    return None


# The vocabulary-parallel log-prob, entropy and normalizer (``vocab_parallel.py``) hold one fp32 block of
# [chunk tokens, V/tp] at a time: 2**24 entries (64 MiB), 1046 tokens of LLaMA-3's 128k vocabulary at tp 8
# (its 16032-column shard), 130 at tp 1. Smaller blocks save little next to the logits themselves and cost
# kernel launches per chunk.
LOGPROB_CHUNK_ELEMENTS = 1 << 24


def logprob_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk of the vocabulary-parallel log-prob over a ``local_vocab``-wide shard (at least one);
    the estimator (``opcount.logprob_peak_bytes``) and the engine share this rule."""
    return max(1, LOGPROB_CHUNK_ELEMENTS // max(1, local_vocab))


def _llama2(name: str, h: int, inter: int, layers: int, heads: int, kv: int) -> ModelConfig:
    return ModelConfig(name, 32000, h, inter, layers, heads, kv, max_position_embeddings=4096, norm_eps=1e-5)


def _llama3(name: str, h: int, inter: int, layers: int, heads: int, kv: int) -> ModelConfig:
    return ModelConfig(name, 128256, h, inter, layers, heads, kv, max_position_embeddings=8192,
                       rope_theta=500000.0, norm_eps=1e-5)


_BASE_CONFIGS: tuple[ModelConfig, ...] = (
    # LLaMA-2 family (34B is the CodeLlama-34B shape, the only public 34B LLaMA-2).
    _llama2("llama2-7b", 4096, 11008, 32, 32, 32),
    _llama2("llama2-13b", 5120, 13824, 40, 40, 40),
    _llama2("llama2-34b", 8192, 22016, 48, 64, 8),
    _llama2("llama2-70b", 8192, 28672, 80, 64, 8),
    # LLaMA-1 33B (its params.json: dim 6656, 60 layers, 52 heads, FFN 17920, 2048 positions): the "33B" of
    # FlexRLHF's Table III (flexrlhf-placement.txt; experiments/ppo_33b_a100_v100.py).
    ModelConfig("llama-33b", 32000, 6656, 17920, 60, 52, 52, max_position_embeddings=2048, norm_eps=1e-6),
    # LLaMA-1 65B (its params.json: dim 8192, 80 layers, 64 heads, FFN 22016): RLHFuse's 65B actor
    # (rlhfuse.txt §7; experiments/ppo_65b_33b.py).
    ModelConfig("llama-65b", 32000, 8192, 22016, 80, 64, 64, max_position_embeddings=2048, norm_eps=1e-5),
    # LLaMA-1 13B/33B/65B shapes (rlhfuse.txt Table 2) with a 4096-token context: RLHFuse's settings generate up
    # to 2048 tokens after the prompt, more than LLaMA-1's 2048 positions hold (experiments/rlhfuse_*.py).
    ModelConfig("llama-13b-4k", 32000, 5120, 13824, 40, 40, 40, max_position_embeddings=4096, norm_eps=1e-6),
    ModelConfig("llama-33b-4k", 32000, 6656, 17920, 60, 52, 52, max_position_embeddings=4096, norm_eps=1e-6),
    ModelConfig("llama-65b-4k", 32000, 8192, 22016, 80, 64, 64, max_position_embeddings=4096, norm_eps=1e-5),
    # realhf-appendix.txt Table 1. Its "7B" column is the LLaMA-3-8B shape.
    _llama3("llama3-8b", 4096, 14336, 32, 32, 8),
    _llama3("llama3-13b", 5120, 13824, 40, 40, 40),
    _llama3("llama3-34b", 8192, 22016, 48, 64, 8),
    _llama3("llama3-70b", 8192, 28672, 80, 64, 8),
    # Qwen2-0.5B's shape (Qwen/Qwen2-0.5B config.json): the model of benchmarks/gpu_check.py and of the
    # measured GPU profiles under profiles/<gpu kind>/.
    ModelConfig("qwen2-0.5b", 151936, 896, 4864, 24, 14, 2, max_position_embeddings=32768, rope_theta=1e6,
                norm_eps=1e-6, tie_embeddings=True, family="qwen2", qkv_bias=True),
    # Qwen3-0.6B / Qwen3-8B (Qwen/Qwen3-*/config.json: head_dim 128 over 16 x 64 / 32 x 128, q/k head norms) and
    # Mistral-7B-v0.3 (mistralai/Mistral-7B-v0.3: 32768 tokens, no sliding window): planning and dry runs of the
    # RL bases users bring most; their checkpoints load through models/families.
    ModelConfig("qwen3-0.6b", 151936, 1024, 3072, 28, 16, 8, max_position_embeddings=40960, rope_theta=1e6,
                norm_eps=1e-6, tie_embeddings=True, family="qwen3", qk_norm=True, explicit_head_dim=128),
    ModelConfig("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, max_position_embeddings=40960, rope_theta=1e6,
                norm_eps=1e-6, family="qwen3", qk_norm=True, explicit_head_dim=128),
    ModelConfig("mistral-7b", 32768, 4096, 14336, 32, 32, 8, max_position_embeddings=32768, rope_theta=1e6,
                norm_eps=1e-5, family="mistral"),
    # Phi-3-mini-4k-instruct (microsoft/Phi-3-mini-4k-instruct: a 2047-token window of 4096 positions in every layer;
    # its checkpoint fuses qkv_proj and gate_up_proj, which models/fused_names.py splits).
    # Gemma 2B and 7B (google/gemma-2b, gemma-7b: head_dim 256, tied embeddings, gelu MLP, (1 + w) norms).
    ModelConfig("gemma-2b", 256000, 2048, 16384, 18, 8, 1, max_position_embeddings=8192, norm_eps=1e-6,
                tie_embeddings=True, family="gemma", explicit_head_dim=256, hidden_act="gelu_pytorch_tanh",
                norm_plus_one=True, embed_scale=True),
    ModelConfig("gemma-7b", 256000, 3072, 24576, 28, 16, 16, max_position_embeddings=8192, norm_eps=1e-6,
                tie_embeddings=True, family="gemma", explicit_head_dim=256, hidden_act="gelu_pytorch_tanh",
                norm_plus_one=True, embed_scale=True),
    # Gemma 3 1B (google/gemma-3-1b-pt: 26 layers, 5 of every 6 windowed to 512 tokens with RoPE base 1e4, the
    # others base 1e6; q/k head norms, norms around both sublayers, 262144-token vocabulary, tied embeddings).
    ModelConfig("gemma3-1b", 262144, 1152, 6912, 26, 4, 1, max_position_embeddings=32768, rope_theta=1e6,
                norm_eps=1e-6, tie_embeddings=True, family="gemma3_text", explicit_head_dim=256,
                hidden_act="gelu_pytorch_tanh", norm_plus_one=True, embed_scale=True, qk_norm=True,
                sliding_window=512, full_attention_layers=(5, 11, 17, 23), sandwich_norms=True,
                query_pre_attn_scalar=256.0, local_rope_theta=10000.0),
    # Gemma 2 2B (google/gemma-2-2b: 26 layers, every other one windowed to 4096 tokens, scores capped at 50 and
    # logits at 30, norms around both sublayers).
    ModelConfig("gemma2-2b", 256000, 2304, 9216, 26, 8, 4, max_position_embeddings=8192, norm_eps=1e-6,
                tie_embeddings=True, family="gemma2", explicit_head_dim=256, hidden_act="gelu_pytorch_tanh",
                norm_plus_one=True, embed_scale=True, sliding_window=4096, full_attention_layers=tuple(range(1, 26, 2)),
                sandwich_norms=True, query_pre_attn_scalar=256.0, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0),
    ModelConfig("phi3-mini", 32064, 3072, 8192, 32, 32, 32, max_position_embeddings=4096, rope_theta=10000.0,
                norm_eps=1e-5, family="phi3", sliding_window=2047),
    # Tiny shapes for the local CPU cluster. Head counts are divisible by 2 and 4
    # so every tp in {1, 2, 4} is legal.
    ModelConfig("tiny", 64, 64, 176, 4, 4, 4, max_position_embeddings=256),
    ModelConfig("tiny-gqa", 64, 64, 176, 4, 4, 2, max_position_embeddings=256),
    ModelConfig("small", 256, 256, 704, 8, 8, 4, max_position_embeddings=512),
    # Between tiny and small (about a quarter of small's forward time): the critic and reward model of
    # benchmarks/bench_fusion.py --setting fit, sized so that their inference on one device about equals a tiny
    # actor's long-tailed generation tail (docs/streaming.md, "A workload where fusion pays").
    ModelConfig("mid", 256, 128, 352, 4, 4, 4, max_position_embeddings=512),
)

# The paper's Figure 5 spells the 7B model "llama7b".
_ALIASES = {"llama7b": "llama2-7b", "llama13b": "llama2-13b", "llama34b": "llama2-34b", "llama70b": "llama2-70b"}

_REGISTRY: "MappingProxyType[str, ModelConfig]" = MappingProxyType({c.name: c for c in _BASE_CONFIGS})


def known_model_types() -> list[str]:
    names = [c.name for c in _BASE_CONFIGS]
    return names + [n + CRITIC_SUFFIX for n in names] + sorted(_ALIASES) + [RULE_MODEL_TYPE]


def is_known_model_type(model_type: str) -> bool:
    return model_type == RULE_MODEL_TYPE or _resolve_base(model_type) in _REGISTRY


def _resolve_base(model_type: str) -> str:
    base = model_type[: -len(CRITIC_SUFFIX)] if model_type.endswith(CRITIC_SUFFIX) else model_type
    return _ALIASES.get(base, base)


def get_model_config(model_type: str) -> ModelConfig:
    """Return the config for ``model_type``; ``X-critic`` is X with a scalar head."""
    if model_type == RULE_MODEL_TYPE:
        raise ValueError(f"model type {RULE_MODEL_TYPE!r} is a parameter-free function and has no model config")
    base = _resolve_base(model_type)
    if base not in _REGISTRY:
        raise ValueError(f"unknown model_type {model_type!r}; known types: {', '.join(known_model_types())}")
    cfg = _REGISTRY[base]
    return cfg.as_critic() if model_type.endswith(CRITIC_SUFFIX) else cfg


def describe(configs: Iterable[ModelConfig]) -> str:
    rows = [f"{'type':<18}{'layers':>7}{'hidden':>8}{'heads':>7}{'kv':>5}{'params':>16}"]
    for c in configs:
        rows.append(f"{c.name:<18}{c.n_layers:>7}{c.hidden_size:>8}{c.n_heads:>7}{c.n_kv_heads:>5}{c.total_params:>16,}")
    return "\n".join(rows)
