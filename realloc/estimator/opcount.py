"""Work of one layer op on one device: FLOPs, bytes of device-memory traffic, kernels, TP collectives.

These counts drive the roofline (``roofline.py``), the extrapolation of measured
profile tables beyond their grid (``profile_table.py``) and the activation
memory (``memory.py``). They describe realloc's own model (``realloc/models``):
a LLaMA block on megatron-core tensor-parallel layers with fused (flash-style)
attention, so no s x s score matrix is ever stored.

Notation: ``t`` = tensor-parallel degree, ``n`` = new tokens in the op (b
sequences x s tokens, or b for one decode step), ``c`` = key/value positions
each new token attends to, ``e`` = bytes per activation element, ``kvl`` = the
k (or v) width one rank holds: kv/t, or one whole head when tp exceeds the KV
heads and they are replicated (``ModelConfig.local_kv_heads``). The vocabulary the head computes,
stores and all-gathers is the padded one the engine holds (``ModelConfig.padded_vocab_size``);
sampling reads the real vocabulary only.

Sequence parallelism (``realloc/models/sequence_parallel.py``) is on for every tp > 1 call, as in
Megatron: the norms, residual adds and layer inputs hold ``n / t`` tokens per rank, and each all-reduce of
the plain tp block becomes an all-gather (of the rank's ``n / t`` tokens) before the column-parallel
projections plus a reduce-scatter (of ``n`` tokens' partial sums) after the row-parallel ones: the same
bytes on a ring (``comm.bus_factor``). At t = 1 every formula below is the plain one.
"""

from __future__ import annotations

import dataclasses
import enum

from realloc.estimator.hardware import Precision
from realloc.models.config import ModelConfig, logprob_chunk_tokens


class Part(str, enum.Enum):
    EMBED = "embed"
    BLOCK = "block"
    HEAD = "head"  # final norm + LM head (+ log-softmax over the vocabulary)
    CRITIC_HEAD = "critic_head"  # final norm + scalar value head


class Phase(str, enum.Enum):
    FWD = "fwd"  # forward over b full sequences of s tokens (training and inference)
    BWD = "bwd"  # backward of FWD
    PREFILL = "prefill"  # forward over b prompts of s tokens that also fills the KV cache
    DECODE = "decode"  # one new token for b sequences with c cached positions


# Kernels one op launches on a GPU, counted from the ops our block runs:
# 2 RMSNorms, fused QKV GEMM, rotary, KV-cache write, attention, O GEMM,
# 2 residual adds, fused gate/up GEMM, SwiGLU, down GEMM. Backward launches
# about twice as many (two GEMMs per forward GEMM). Collectives are not
# counted here; the communication model times them.
_KERNELS = {
    (Part.EMBED, Phase.FWD): 3, (Part.EMBED, Phase.PREFILL): 3, (Part.EMBED, Phase.DECODE): 3,
    (Part.EMBED, Phase.BWD): 3,
    (Part.BLOCK, Phase.FWD): 11, (Part.BLOCK, Phase.PREFILL): 12, (Part.BLOCK, Phase.DECODE): 12,
    (Part.BLOCK, Phase.BWD): 22,
    # head: norm, GEMM, then log-softmax / gather (fwd) or sampling (prefill, decode: sort, softmax,
    # cumsum, search, gathers, log-softmax)
    (Part.HEAD, Phase.FWD): 7, (Part.HEAD, Phase.PREFILL): 14, (Part.HEAD, Phase.DECODE): 14,
    (Part.HEAD, Phase.BWD): 8,
    (Part.CRITIC_HEAD, Phase.FWD): 3, (Part.CRITIC_HEAD, Phase.PREFILL): 3, (Part.CRITIC_HEAD, Phase.DECODE): 3,
    (Part.CRITIC_HEAD, Phase.BWD): 4,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective inside the tp group: ``op`` over ``nbytes`` per rank (the input size)."""

    op: str  # "all_reduce" | "all_gather" | "reduce_scatter"
    nbytes: float
    count: int = 1


@dataclasses.dataclass(frozen=True)
class OpWork:
    """Per-device work of one op. GEMM, attention and elementwise parts are kept
    apart because each meets its own roofline (a decode GEMM is bandwidth-bound
    on its weights while its attention is bandwidth-bound on the KV cache)."""

    gemm_flops: float = 0.0
    gemm_bytes: float = 0.0
    attn_flops: float = 0.0
    attn_bytes: float = 0.0
    elem_bytes: float = 0.0
    kernels: int = 0
    tp_collectives: tuple[Collective, ...] = ()

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.attn_flops


def block_kernels(cfg: ModelConfig, phase: Phase) -> int:
    """Kernels of one block in ``phase``: ``_KERNELS``'s, plus Qwen3's two head norms and Gemma 3's two more layer
    norms (``sandwich_norms``), each twice in a backward."""
    extra = ((4 if phase is Phase.BWD else 2) if cfg.qk_norm else 0) + (
        (4 if phase is Phase.BWD else 2) if cfg.sandwich_norms else 0)
    return _KERNELS[(Part.BLOCK, phase)] + extra


def local_kv_width(cfg: ModelConfig, tp: int) -> int:
    """Width of the k (or v) projection output on one tp rank (``kvl``)."""
    return cfg.local_kv_heads(tp) * cfg.head_dim


def local_block_matmul_params(cfg: ModelConfig, tp: int) -> float:
    """Weights of the four attention and three MLP projections of one block on one tp rank."""
    h, q, inter = cfg.hidden_size, cfg.q_dim, cfg.intermediate_size
    return (2 * h * q + 3 * h * inter) / tp + 2 * h * local_kv_width(cfg, tp)


def lora_backward_flops(cfg: ModelConfig, tp: int, n_tok: int) -> float:
    """FLOPs of one block's LoRA adapters in a backward on one tp rank: per adapted linear the forward's two
    r-wide GEMMs (input x A^T, then u B^T) again for the input gradients and twice for A's and B's gradients,
    3 x 2 x n x r x (in + out), with the split factor of each adapter's local shape."""
    lora = cfg.lora
    if lora is None:
        return 0.0
    h, q, kv, inter = cfg.hidden_size, cfg.q_dim, local_kv_width(cfg, tp) * tp, cfg.intermediate_size
    # (in, out) with the split side divided by tp: column layers split out, row layers split in
    shapes = {"q_proj": (h, q / tp), "k_proj": (h, kv / tp), "v_proj": (h, kv / tp), "o_proj": (q / tp, h),
              "gate_proj": (h, inter / tp), "up_proj": (h, inter / tp), "down_proj": (inter / tp, h)}
    return sum(6.0 * n_tok * lora.rank * (a + b) for a, b in (shapes[m] for m in lora.target_modules))


def _block_fwd(cfg: ModelConfig, t: int, b: int, s: int, c_attn: float, c_read: int, e: int,
               phase: Phase) -> OpWork:
    h, q, kvl, inter = cfg.hidden_size, cfg.q_dim, local_kv_width(cfg, t), cfg.intermediate_size
    n = b * s
    weights = local_block_matmul_params(cfg, t)
    # GEMM inputs: qkv <- norm1 out (h), o <- attn out (q/t), gate/up <- norm2 out (h), down <- act (inter/t);
    # outputs: qkv q/t + 2kvl, o (h, partial sum before the all-reduce), gate+up 2*inter/t, down (h).
    # (q = n_heads * head_dim: h unless the checkpoint sets head_dim.)
    gemm_act = n * (h + q / t + h + inter / t + q / t + 2 * kvl + h + 2 * inter / t + h)
    attn_flops = 4.0 * n * c_attn * q / t  # QK^T and PV, 2 FLOPs per MAC each
    # fused attention reads q and the k/v of every attended position once per sequence and writes o
    attn_bytes = (n * 2 * q / t + b * c_read * 2 * kvl) * e
    # 2 RMSNorms (r+w h), rotary on q,k (r+w), 2 residual adds (2r+1w h), SwiGLU (2r+1w inter/t),
    # plus the KV-cache write when generating.
    writes_cache = phase in (Phase.PREFILL, Phase.DECODE)
    elem = n * (4 * h + 2 * (q / t + kvl) + 6 * h + 3 * inter / t + (2 * kvl if writes_cache else 0)
                + (2 * (q / t + kvl) if cfg.qk_norm else 0)  # Qwen3's q/k head norms (r+w q/t and kvl)
                + (4 * h if cfg.sandwich_norms else 0))  # Gemma 3's two more norms (r+w h)
    # whole sequences (FWD, and BWD after it) run sequence parallel: all-gather before q/k/v and gate/up,
    # reduce-scatter after o and down (their backwards swap them, so BWD has the same pairs); generation
    # (PREFILL, DECODE) all-reduces the outputs of o and down
    if t == 1:
        coll: tuple[Collective, ...] = ()
    elif phase is Phase.FWD:
        coll = (Collective("all_gather", n * h * e / t, 2), Collective("reduce_scatter", n * h * e, 2))
    else:
        coll = (Collective("all_reduce", n * h * e, 2),)
    return OpWork(gemm_flops=2.0 * n * weights, gemm_bytes=weights * e + gemm_act * e, attn_flops=attn_flops,
                  attn_bytes=attn_bytes, elem_bytes=elem * e, kernels=block_kernels(cfg, phase), tp_collectives=coll)


def kept_prefill_block_work(cfg: ModelConfig, tp: int, b: int, s: int, kept: int, precision: Precision) -> OpWork:
    """One block's prefill of ``s`` new tokens per sequence after ``kept`` positions whose keys and values are
    kept in the cache (a multi-turn rollout's later turn, ``models/turn_cache.py``): token i of the new ones
    attends the kept positions and i + 1 new ones, kept + (s + 1) / 2 on average, and every kept key is read."""
    return _block_fwd(cfg, tp, b, s, kept + (s + 1) / 2, kept + s, precision.param, Phase.PREFILL)


def op_work(cfg: ModelConfig, part: Part, phase: Phase, tp: int, b: int, s: int, precision: Precision) -> OpWork:
    """Work of ``part`` in ``phase`` on one device of a tp group.

    For FWD/BWD/PREFILL, ``b`` sequences of ``s`` tokens; for DECODE, ``b``
    sequences each adding one token to a cache of ``s`` positions.
    """
    e, t = precision.param, tp
    h = cfg.hidden_size
    decode = phase is Phase.DECODE
    n = b if decode else b * s
    if part is Part.BLOCK:
        if decode:
            return _block_fwd(cfg, t, b, 1, float(s), s, e, Phase.DECODE)
        # causal: token i attends i+1 positions, (s+1)/2 on average; flash kernels skip masked tiles
        fwd = _block_fwd(cfg, t, b, s, (s + 1) / 2, s, e, Phase.PREFILL if phase is Phase.PREFILL else Phase.FWD)
        if phase is not Phase.BWD:
            return fwd
        # backward: two GEMMs per forward GEMM (input and weight grads, the latter accumulated into
        # fp32 main_grad), flash backward recomputes scores: ~2.5x forward attention FLOPs.
        weights = local_block_matmul_params(cfg, t)
        # sequence parallel: the projections gather their input again (sequence_parallel.gather_project), two
        # more all-gathers besides the swapped pairs
        coll = tuple(dataclasses.replace(c, count=2 * c.count) if c.op == "all_gather" else c
                     for c in fwd.tp_collectives)
        if cfg.lora is not None:
            # LoRA: the frozen projections compute input gradients only (one GEMM each, no gathered input for a
            # weight gradient); the adapters' r-wide GEMMs are small next to them (lora_backward_flops)
            return OpWork(gemm_flops=fwd.gemm_flops + lora_backward_flops(cfg, t, n), gemm_bytes=fwd.gemm_bytes,
                          attn_flops=2.5 * fwd.attn_flops, attn_bytes=2 * fwd.attn_bytes,
                          elem_bytes=2 * fwd.elem_bytes, kernels=block_kernels(cfg, Phase.BWD),
                          tp_collectives=fwd.tp_collectives)
        return OpWork(gemm_flops=2 * fwd.gemm_flops,
                      gemm_bytes=2 * (fwd.gemm_bytes - weights * e) + weights * (e + 2 * precision.grad),
                      attn_flops=2.5 * fwd.attn_flops, attn_bytes=2 * fwd.attn_bytes, elem_bytes=2 * fwd.elem_bytes,
                      kernels=block_kernels(cfg, Phase.BWD), tp_collectives=coll)
    if part is Part.EMBED:
        # vocab-parallel lookup: each rank gathers its rows and zeroes the rest, then the tp all-reduce sums;
        # each rank keeps its n/t tokens (sequence parallel) when the whole sequences go on to blocks
        coll = (Collective("all_reduce", n * h * e),) if t > 1 and phase is not Phase.BWD else ()
        if phase is Phase.BWD:  # all-gather of the tokens' grads, scatter-add into the fp32 embedding grad
            coll = (Collective("all_gather", n * h * e / t),) if t > 1 else ()
            return OpWork(elem_bytes=n * h * (e + 2 * precision.grad), kernels=_KERNELS[(part, phase)],
                          tp_collectives=coll)
        return OpWork(elem_bytes=3 * n * h * e, kernels=_KERNELS[(part, phase)], tp_collectives=coll)
    if part is Part.CRITIC_HEAD:
        # a [1, h] projection, replicated on every tp rank: no collective for its own sake; with sequence
        # parallelism (FWD, BWD) each rank scores its n/t tokens and all-gathers the values
        sp = t > 1 and phase in (Phase.FWD, Phase.BWD)
        work = OpWork(gemm_flops=2.0 * n * h, gemm_bytes=(n * h + h + n) * e, elem_bytes=2 * n * h * e,
                      kernels=_KERNELS[(part, phase)],
                      tp_collectives=(Collective("all_gather", n * e / t),) if sp and phase is Phase.FWD else ())
        return dataclasses.replace(work, gemm_flops=2 * work.gemm_flops, gemm_bytes=2 * work.gemm_bytes,
                                   elem_bytes=2 * work.elem_bytes) if phase is Phase.BWD else work
    # LM head: RMSNorm, column-parallel [V/t, h] projection, then:
    #  FWD: vocab-parallel log-softmax + gather (3 passes over fp32 logits, 3 tiny all-reduces of n floats).
    #  Chunking (``vocab_parallel``) changes where the fp32 values live, not how often they are streamed: the
    #  max now reads the logits themselves and each chunk's copy, exp and sum stream it as the unfused ops did.
    #  PREFILL: logits of the last prompt token only; DECODE: logits of b tokens, all-gathered for sampling
    v = cfg.padded_vocab_size / t
    lg = precision.logits
    if phase is Phase.PREFILL:
        n_out = b
    else:
        n_out = n
    gemm = OpWork(gemm_flops=2.0 * n_out * h * v, gemm_bytes=(h * v + n_out * h) * e + n_out * v * lg,
                  elem_bytes=2 * n_out * h * e)
    if phase is Phase.FWD:
        # the normed tokens' all-gather (sequence parallel), then the log-softmax's three small all-reduces
        coll = (Collective("all_gather", n * h * e / t), Collective("all_reduce", n * lg, 3)) if t > 1 else ()
        return dataclasses.replace(gemm, elem_bytes=gemm.elem_bytes + 3 * n * v * lg,
                                   kernels=_KERNELS[(part, phase)], tp_collectives=coll)
    if phase is Phase.BWD:
        # softmax grad (r logits, w grad; recomputed per chunk), two GEMMs, the normed tokens gathered again and
        # the input grad's reduce-scatter to the rank's tokens (sequence parallel)
        coll = (Collective("all_gather", n * h * e / t), Collective("reduce_scatter", n * h * e)) if t > 1 else ()
        if cfg.lora is not None:  # a frozen head: the input gradient only
            return OpWork(gemm_flops=gemm.gemm_flops, gemm_bytes=gemm.gemm_bytes,
                          elem_bytes=2 * gemm.elem_bytes + 2 * n * v * lg, kernels=_KERNELS[(part, phase)],
                          tp_collectives=coll[1:])
        return OpWork(gemm_flops=2 * gemm.gemm_flops, gemm_bytes=2 * gemm.gemm_bytes + h * v * 2 * precision.grad,
                      elem_bytes=2 * gemm.elem_bytes + 2 * n * v * lg, kernels=_KERNELS[(part, phase)],
                      tp_collectives=coll)
    # PREFILL / DECODE: sample from full-vocabulary logits (realloc.models.sampling), the padding cut
    # off: a sort of b x V fp32 keys with int64 indices (a radix sort streams them ~4 times), softmax,
    # cumsum, log-softmax: ~12 passes over b x V x 4 bytes.
    coll = (Collective("all_gather", n_out * v * lg),) if t > 1 else ()
    return dataclasses.replace(gemm, elem_bytes=gemm.elem_bytes + 12 * n_out * cfg.vocab_size * lg,
                               kernels=_KERNELS[(part, phase)], tp_collectives=coll)


def head_part(cfg: ModelConfig) -> Part:
    return Part.CRITIC_HEAD if cfg.is_critic else Part.HEAD


# -- memory -----------------------------------------------------------------

# Per-token tensors of the chunked log-prob besides the logits and the fp32 block (``vocab_parallel``): the
# forward's target ids (int64), max and sum (fp32); the backward's saved target ids (int64) and log Z (fp32),
# the target's column in the shard (int64), whether the shard holds it (bool) and the gradient there (fp32).
LOGPROB_FORWARD_SCALARS = 8 + 4 + 4
LOGPROB_BACKWARD_SCALARS = 8 + 4 + 8 + 1 + 4


def norm_saved_bytes_per_token(cfg: ModelConfig, precision: Precision, tp: int = 1) -> float:
    """What one RMSNorm and the projections reading it keep for the backward (``llama.RMSNorm``, issue 21's
    lean norm): its input in the compute dtype and 1/rms (one fp32 scalar per token), and the scaled output
    the projections read. (Autograd on the unfused formula kept 4h bytes more per token: the fp32 input, or
    its fp32 copy in bf16, instead of the input, and the normalized product cast back.)

    With sequence parallelism (tp > 1) all of it is the rank's n/t tokens: the norm runs on them, and the
    projections keep the norm's output before their all-gather and gather it again in their backward
    (``sequence_parallel.gather_project``), as Megatron's sequence-parallel linear layers do."""
    return (2 * precision.param * cfg.hidden_size + 4) / tp


def saved_activation_bytes_per_token(cfg: ModelConfig, tp: int, precision: Precision) -> float:
    """Bytes one block keeps per token for its backward without recomputation (``llama.DecoderLayer``
    with fused attention; measured exactly by ``realloc.models.activations`` on CPU).

    Two norms (``norm_saved_bytes_per_token``; Gemma 3's two more below); attention: q after rotary, k and v as
    the kernel reads them (GQA groups repeated to the local q heads, so q_dim/t each), its output and a
    log-sum-exp per row and head (fp32); the MLP: gate, up, SwiGLU(gate) and its product with up.
    Rotary multiplies by cos/sin that need no gradient, so it keeps nothing of its own. Qwen3's q and k head
    norms keep their inputs (the projections' outputs, q/t and kvl wide) and 1/rms per head (fp32).
    """
    inter, t, e = cfg.intermediate_size, tp, precision.param
    attn = 4 * cfg.q_dim / t * e + cfg.n_heads / t * 4
    if cfg.qk_norm:
        attn += (cfg.q_dim / t + local_kv_width(cfg, t)) * e + (cfg.n_heads / t + cfg.local_kv_heads(t)) * 4
    mlp = 4 * inter / t * e
    # Gemma 3 normalizes each sublayer's output too: those two norms keep their input and 1/rms, and their output
    # goes to the residual add, which keeps nothing
    post = 2 * (precision.param * cfg.hidden_size + 4) / tp if cfg.sandwich_norms else 0
    return 2 * norm_saved_bytes_per_token(cfg, precision, tp) + post + attn + mlp


def layer_input_bytes_per_token(cfg: ModelConfig, precision: Precision, tp: int) -> float:
    """What a recomputed block keeps until its backward: its input (Megatron's full recomputation),
    the rank's n/t tokens under sequence parallelism."""
    return cfg.hidden_size * precision.param / tp


def stage_saved_bytes_per_token(cfg: ModelConfig, first_stage: bool, precision: Precision) -> float:
    """Saved once per stage and micro-batch besides the blocks: rotary cos and sin (shared by the
    stage's blocks) and, on the first stage, the token ids the embedding keeps (int64)."""
    return rope_bytes_per_token(cfg, precision) + (8 if first_stage else 0)


def head_saved_bytes_per_token(cfg: ModelConfig, tp: int, precision: Precision) -> float:
    """What the last stage's head keeps for the backward: the final norm (the rank's n/t tokens under sequence
    parallelism) and, for a vocabulary head, what the chunked log-prob (``realloc.models.vocab_parallel``) saves:
    the logits of the rank's vocabulary shard in the compute dtype, each position's target id (int64) and its
    log-normalizer (fp32). The LM head's projection all-gathers the tokens first, so the log-prob holds all n."""
    logits = 0 if cfg.is_critic else cfg.padded_vocab_size / tp * precision.param + 8 + 4
    return norm_saved_bytes_per_token(cfg, precision, tp) + logits


def logprob_peak_bytes(cfg: ModelConfig, tp: int, precision: Precision, backward: bool, n_tok: int) -> float:
    """Peak live bytes of the vocabulary-parallel log-prob (``realloc.models.vocab_parallel``) of ``n_tok`` tokens
    over the rank's V/t logits, temporaries included (measured by ``LiveTensorMeter``); the temperature divides
    the fp32 block in place, so any temperature holds the same.

    It walks the tokens in chunks of ``config.logprob_chunk_tokens(V/t)`` and holds one fp32 [chunk, V/t] block
    at a time (issue 21: 4 fp32 copies of the logits before). Without grad (INFERENCE): the logits in the
    compute dtype, that block and a few per-token scalars (max, sum, log Z, target, picked logit). A training
    step peaks in the backward: the saved logits, their gradient in the compute dtype, the block and the
    per-token scalars of both passes. Its forward peak is the no-grad one, lower."""
    if cfg.is_critic:
        return 0.0
    v, e = cfg.padded_vocab_size / tp, precision.param
    chunk = min(n_tok, logprob_chunk_tokens(cfg.padded_vocab_size // tp)) * v * precision.logits
    if backward:
        return n_tok * (2 * v * e + LOGPROB_BACKWARD_SCALARS) + chunk
    return n_tok * (v * e + LOGPROB_FORWARD_SCALARS) + chunk


def sampling_bytes_per_row(cfg: ModelConfig) -> float:
    """Peak live bytes of sampling one token for one sequence (``realloc.models.sampling.sample_tokens``)
    from its gathered fp32 full-vocabulary logits, with a top-p filter (the worst case; measured by
    ``LiveTensorMeter``): the logits, logits / temperature, the sort's int64 order, the top-k keep mask
    (bool), the masked sorted logits, their softmax, the mass before each token and its top-p mask
    (bool), and the filtered probabilities: 4 + 4 + 8 + 1 + 4 + 4 + 4 + 1 + 4 bytes per vocabulary entry.
    The gathered logits have the padded vocabulary's width, the rest the real one (generation cuts the padding)."""
    return 4.0 * cfg.padded_vocab_size + 30.0 * cfg.vocab_size


def transient_activation_bytes_per_token(cfg: ModelConfig, tp: int, precision: Precision,
                                         sequence_parallel: bool = True) -> float:
    """Peak live bytes per token inside one block's forward without grad (measured by ``LiveTensorMeter``):
    the larger of its MLP's and its attention's working sets. At the MLP: the stage's input (its caller holds
    it until the stage returns), the block's input, the residual after attention, the second norm's output
    (all h wide on every tp rank), and SwiGLU(gate), up and their product (inter/t each). LLaMA/Qwen2 shapes
    peak there (their MLP is about 2.7 times wider than q_dim); a wide-q, narrow-MLP model peaks in attention
    (``attention_working_bytes_per_token``). Training adds it on top of the saved activations, an upper bound
    for the backward's own gradients of one block.

    With sequence parallelism (tp > 1; whole sequences, not generation's prefill) the four h-wide tensors hold
    the rank's n/t tokens, and the MLP peaks at the largest of: its projections (the all-gathered norm output,
    h wide over all n tokens, with gate and up), SwiGLU (gate, up and their product, 3 inter/t), and the down
    projection (the product, its partial output h wide, and the reduce-scattered h/t)."""
    h, inter, t = cfg.hidden_size, cfg.intermediate_size, tp
    attention = attention_working_bytes_per_token(cfg, tp, precision, sequence_parallel)
    if not sequence_parallel or tp == 1:
        return max((4 * h + 3 * inter / t) * precision.param, attention)
    i = inter / t
    mlp = 4 * h / t + max(h + 2 * i, 3 * i, i + h + h / t)
    return max(mlp * precision.param, attention)


def attention_working_bytes_per_token(cfg: ModelConfig, tp: int, precision: Precision,
                                      sequence_parallel: bool = True) -> float:
    """Peak live bytes per token in ``llama.Attention.forward`` without grad: the stage's and the block's input
    and the first norm's output (h wide each), plus the rank's q (``q``, n_heads/t heads) and k, v (``kv``,
    its local KV heads) tensors at the largest of three moments (``rope(x) = x*cos + rotate_half(x)*sin``
    holds x, x*cos, rotate_half(x) and its product at once):
    rotating q (q, three temporaries, k, v): 4q + 2kv; rotating k (rotated q, k, three temporaries, v):
    q + 5kv; re-laying the attention output (q, k and v repeated to q heads, the output and its copy): 5q.
    MHA peaks at 6q, GQA with two or more q heads per KV head at 5q. With sequence parallelism (tp > 1) the
    three h-wide tensors are the rank's n/t tokens, and two more moments hold all n tokens h wide: the
    projections (the all-gathered norm output with q, k, v) and the o projection (q, k, v, the output and
    o's partial h-wide result, then its reduce-scattered h/t)."""
    h = cfg.hidden_size
    if not sequence_parallel or tp == 1:
        return (3 * h + _attention_qkv_elems(cfg, tp, precision.param)) * precision.param
    return (3 * h / tp + _attention_sp_elems(cfg, tp, precision.param)) * precision.param


def _attention_qkv_elems(cfg: ModelConfig, tp: int, e: int) -> float:
    """The q- and kv-wide part of ``attention_working_bytes_per_token``, in elements of ``e`` bytes per token.

    Qwen3's head norms (``llama._rms_norm`` on q, then on k) add two moments: the input, its fp32 copy (none
    when the input is fp32) and its fp32 square beside the other tensors, 5q + 2kv and q + 6kv in bf16."""
    q, kv = cfg.q_dim // tp, local_kv_width(cfg, tp)
    rotary = max(4 * q + 2 * kv, q + 5 * kv, 5 * q)
    if not cfg.qk_norm:
        return rotary
    norm = 1 + (0 if e == 4 else 4 / e) + 4 / e  # the input, its fp32 copy, its square; per element normalized
    return max(rotary, norm * q + 2 * kv, q + norm * kv + kv)


def _attention_sp_elems(cfg: ModelConfig, tp: int, e: int) -> float:
    """Under sequence parallelism, the part of ``attention_working_bytes_per_token`` beyond the three h/t-wide
    tensors: rotary's q/kv temporaries, or the projections' gathered input with q, k, v, or the o projection's
    partial h-wide output with its inputs and the reduce-scattered h/t."""
    h, q, kv = cfg.hidden_size, cfg.q_dim // tp, local_kv_width(cfg, tp)
    return max(_attention_qkv_elems(cfg, tp, e), h + q + 2 * kv, 4 * q + h + h / tp)


def block_backward_bytes_per_token(cfg: ModelConfig, tp: int, precision: Precision, recompute: bool) -> float:
    """Peak live bytes per token of one block's backward beyond what it saved (measured by
    ``LiveTensorMeter``).

    The RMSNorm's backward works on the rank's tokens (n/t of them under sequence parallelism): the
    compute-dtype gradient of its output, one fp32 h-wide buffer, and the input's gradient cast back to the
    compute dtype (the buffer itself in fp32), plus the recomputed block's output and residual when recomputing.
    Under sequence parallelism a projection's backward gathers its input again (h wide over all n tokens) beside
    the input's gradient (h wide, before its reduce-scatter) and its outputs' gradients (q + 2kv, or gate and up).
    Without recomputation, the largest of these and the forward's working set
    (``transient_activation_bytes_per_token``; it also bounds the MLP's and the attention's backward). When
    recomputing, the recomputed block's saves are counted beside this (``memory._train_parts``) and they already
    hold every h/t-wide tensor of that working set (the stage's and block's inputs are kept layer inputs, the
    norms keep their inputs, the projections the norms' outputs) and the MLP's four inter/t-wide ones, so what
    runs on top of them is the largest of the norm's backward, attention's q/kv temporaries (rotary's, and under
    sequence parallelism the gathered input and the o projection's partial output,
    ``attention_working_bytes_per_token``), the MLP's backward (the gradients of its inter/t-wide tensors, three
    at most, beside the recomputed block's output and its gradient, h/t each under sequence parallelism) and the
    projections' re-gather.
    """
    h, e = cfg.hidden_size, precision.param
    sp = tp > 1
    norm = (4 + (0 if e == 4 else e) + e * (3 if recompute else 1)) * h / tp
    # sequence parallel: a projection's backward gathers its input again (h wide, all n tokens) beside the input's
    # gradient (h wide) and its outputs' gradients (q + 2kv, or gate and up)
    regather = (2 * h + max(cfg.q_dim / tp + 2 * local_kv_width(cfg, tp), 2 * cfg.intermediate_size / tp)) * e
    regather = regather if sp else 0.0
    if not recompute:
        return max(transient_activation_bytes_per_token(cfg, tp, precision), norm, regather)
    attention = (_attention_sp_elems(cfg, tp, e) if sp else _attention_qkv_elems(cfg, tp, e)) * e
    mlp = (3 * cfg.intermediate_size / tp + 2 * h / tp) * e
    return max(norm, attention, mlp, regather)


def pipeline_held_bytes_per_token(cfg: ModelConfig, precision: Precision, last: bool, tp: int = 1) -> float:
    """What 1F1B holds per in-flight micro-batch besides the saved activations (``realloc.models.pipeline``):
    the stage's output until the gradient for it arrives (not the last stage, whose output is the loss), the
    rank's n/t tokens under sequence parallelism. The received input is a saved tensor already: the first
    block's norm keeps its input as it is, and recomputation keeps the layer inputs."""
    return 0.0 if last else cfg.hidden_size * precision.param / tp


def rope_bytes_per_token(cfg: ModelConfig, precision: Precision) -> float:
    """Rotary cos and sin, computed once per stage and micro-batch and shared by its blocks."""
    return 2 * cfg.head_dim * precision.param


def kv_cache_bytes_per_token_layer(cfg: ModelConfig, tp: int, precision: Precision) -> float:
    """K and V of one position in one layer on one tp rank (its local KV heads, replicated or not)."""
    return 2 * local_kv_width(cfg, tp) * precision.param
