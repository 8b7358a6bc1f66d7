"""Device memory of calls and plans (realhf.txt section 5.1, "maximum memory allocated", Table 2).

Rules, applied per device ``d`` (the search's simulator applies the same ones):

1. The *layout* of a call is (mesh name, dp, tp, pp); n_mbs does not change it.
   The *home layout* of a model is the layout of its first TRAIN_STEP call if it
   has one (a *trainable* model), else the layout of its first call in the
   graph's topological order (a *frozen* model).
2. Static(d) = sum over models whose home layout covers d of
   - the parameters of d's shard in the home layout, unless the model is frozen
     and the plan offloads it (``ExecutionPlan.offload``) to host memory;
   - for a trainable model, its optimizer states in the home layout. Optimizer
     state never moves (principle 1). Gradients live in the ``main_grad``
     buffers of ``precision.grad`` bytes per parameter: fp32 (4 B), or bf16 (2 B)
     when the train call's settings say ``grad_dtype="bf16"``
     (``CostModel.call_precision``); the engine allocates them when a train step
     starts and frees them when it ends (``ParallelModel.train_step``), so they
     are the train call's dynamic memory (rule 3), not static: measured on an
     H200, a 0.5B bf16 actor holds 7.6 GiB between calls, not the 9.4 GiB that
     static gradients would add up to (benchmarks/gpu_check.py). With dp > 1
     the optimizer state is sharded over dp (``models/zero.py``, ZeRO stage 1):
     each dp rank holds ``precision.optimizer`` bytes (bf16: fp32 master, Adam m
     and v, 12 B; fp32: m and v, 8 B) for its chunk of every tensor, ceil(n / dp)
     of n elements (``local_optimizer_elems``), so a bf16 parameter costs
     2 + 4 + 12/dp bytes (18 at dp 1, 12 at dp 2), or with bf16 gradients
     2 + 2 + 12/dp (16 at dp 1, 10 at dp 2).
3. Dynamic_c(d), for a call c whose layout covers d =
   activations of c on d + KV cache of c on d + gradients of c on d (train calls)
   + c's parameter shard on d if c runs on a *reallocated copy*: its layout
     differs from its model's home layout, or its model is offloaded. A copy
     exists only while c runs (principle 2: parameters move, and are freed
     after the call).
4. Peak(d) = Static(d) + max over calls c covering d of Dynamic_c(d); 0 dynamic
   if no call covers d. Calls on one device never run at the same time
   (overlapping meshes serialize, Algorithm 1), so their dynamic memory never adds.
5. Data-transfer buffers are negligible (principle 4).

Per-call formulas, on a device of pipeline stage ``k`` holding ``L_k`` blocks,
micro-batch of ``b`` sequences, ``t`` = tp, ``m`` = n_mbs. Per-token byte counts are
in ``opcount.py``; the saved ones are exact against ``realloc.models.activations.SavedTensorMeter``
and the peaks (temporaries included) are checked against ``LiveTensorMeter`` on CPU:
- parameters: the exact shard of ``param_layout.stage_param_specs`` x bytes/param
  (a KV head replicated over tp ranks counts on each of them);
- TRAIN_STEP: 1F1B keeps min(m, pp - k) micro-batches of saved activations
  (``opcount.saved_activation_bytes_per_token`` x L_k x b x seq_len, plus rotary
  tables and token ids; with activation recomputation a block keeps only its input,
  h elements per token of the rank's 1/t of the tokens), and for each of them the
  stage's output until its gradient arrives (``opcount.pipeline_held_bytes_per_token``,
  1/t of the tokens too; the received input is the first norm's saved input).
  Sequence parallelism is on for every TRAIN_STEP and INFERENCE call with t > 1
  (``models/sequence_parallel.py``): the norms, residuals, layer inputs and the
  hidden states sent between stages hold n/t tokens per rank, and the projections
  keep the norm outputs' n/t tokens and all-gather them in their forward and again in
  their backward; GENERATE runs without it. With sequence packing the engine packs
  first and splits the packed rows' flattened tokens over t. Each RMSNorm saves its
  input in the compute dtype and one fp32 1/rms per token, and its backward holds one
  fp32 h-wide buffer besides its output's and input's gradients (``llama.RMSNorm``,
  issue 21), all over the rank's tokens. On top of them runs one of: a block
  (its backward's working set, ``opcount.block_backward_bytes_per_token``, and one weight's
  gradient; when recomputing, the recomputed block's full saved set and the largest of its
  unsaved temporaries), on the last stage the head (the final norm's
  saves and the chunked log-prob's peak in its backward: the saved logits and their
  gradient in the compute dtype, a few per-token scalars, and one fp32 block of
  min(tokens, ``config.logprob_chunk_tokens``) x V/t, over all n tokens since the LM
  head all-gathers them; ``opcount.logprob_peak_bytes``),
  or on the first stage the embedding's gradient; they never run
  at once, so the largest counts. After the backward, the optimizer update's fp32
  temporaries, if larger (``optimizer_step_bytes``: AdamW's on the largest tensors, or
  their dp chunks, with bf16 gradients also the fp32 copy of the one being stepped, and
  with dp > 1 the distributed optimizer's flat reduce-scatter and all-gather buffers).
  ``train_saved_bytes`` is the
  saved part alone;
- INFERENCE: one micro-batch's working set of one block plus the rotary tables, or on
  the last stage the log-prob's peak over its V/t logits (the logits in the compute
  dtype, per-token scalars and one fp32 block of a chunk of tokens), whichever is larger; a stage
  before the last also holds its previous output until the next stage receives it;
- GENERATE: KV cache of (prompt_len + gen_len) positions x L_k layers of the
  rank's KV heads (n_kv/t, or one whole head when tp exceeds them) for one
  micro-batch of b sequences with pp = 1 (micro-batches generate one after
  another), for min(n_mbs, pp) micro-batches with pp > 1 (pipelined, at most pp in
  flight; ``realloc.models.generation``), plus the larger of the prefill's working
  set for one micro-batch and, on the last stage, sampling its b sequences from
  full-vocabulary fp32 logits (``opcount.sampling_bytes_per_row``); a stage before
  the last also holds each in-flight micro-batch's prefill output until the next
  stage receives it.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from realloc.calls import InterfaceType
from realloc.estimator.hardware import Precision
from realloc.estimator.mask_memory import stage_mask_bytes
from realloc.estimator.packed_rows import packed_shape, slow_rank_shape
from realloc.estimator.opcount import (block_backward_bytes_per_token, head_saved_bytes_per_token,
                                       kv_cache_bytes_per_token_layer, layer_input_bytes_per_token,
                                       logprob_peak_bytes, norm_saved_bytes_per_token,
                                       pipeline_held_bytes_per_token, rope_bytes_per_token, sampling_bytes_per_row,
                                       saved_activation_bytes_per_token, stage_saved_bytes_per_token,
                                       transient_activation_bytes_per_token)
from realloc.lengths import ResponseLengths
from realloc.models.config import ModelConfig
from realloc.models.param_layout import (is_trained, shard_numel, stage_layer_ranges, stage_param_specs,
                                         trained_shard_numel)
from realloc.models.zero_chunks import chunk_numel, plan_buckets
from realloc.strategy import ParallelStrategy


@dataclasses.dataclass(frozen=True)
class CallMemory:
    """Bytes on one device, by the memory types of realhf.txt Table 2."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache

    @property
    def dynamic(self) -> int:
        """Memory that exists only while the call runs (its parameters excluded): a train step's gradient
        buffers too, which the engine allocates at the step's start and frees at its end."""
        return self.grads + self.activations + self.kv_cache


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one call processes, per step (a PPO mini-batch for training)."""

    interface: InterfaceType
    n_seqs: int  # sequences per step (graph.steps_n_seqs)
    n_steps: int  # optimizer steps per call (n_minibatches); 1 otherwise
    prompt_len: int
    gen_len: int
    # How long responses are (issue 31): time is priced on the lengths that exist (call_time.py); memory stays
    # at the longest, gen_len, which any one row may reach.
    lengths: ResponseLengths = ResponseLengths()
    # A generation whose rows end where a seeded length schedule says (``PPOConfig.length_schedule``, issue 31
    # item 6): each decode step also bans EOS and places it (``engine.schedule_step``).
    scheduled: bool = False
    # Rows dealt to dp ranks by tokens (``RunConfig.balance_tokens``): the slowest rank's rows (``packed``).
    balanced: bool = False

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    def packed(self, b: int, dp: int = 1) -> tuple[int, int]:
        """(rows, tokens per row) a packed micro-batch of ``b`` sequences runs as (``models/packing.py``): rows as
        wide as its longest sequence (the expected longest of b responses), as many as first-fit decreasing fills
        with the expected lengths (``packed_rows.packed_shape``). Fixed lengths: b rows of seq_len. At ``dp`` > 1:
        the slowest rank's micro-batch, which holds the longest of the dp ranks' rows (``slow_rank_shape``)."""
        if self.lengths.is_fixed:
            return b, self.seq_len
        if dp > 1:
            return slow_rank_shape(self.lengths, self.prompt_len, self.gen_len, b, dp, self.balanced)
        return packed_shape(self.lengths, self.prompt_len, self.gen_len, b)

    def micro_batch(self, dp: int, n_mbs: int) -> int:
        """Sequences in one micro-batch of one dp rank; the largest one when the split is uneven."""
        return max(1, math.ceil(self.n_seqs / (dp * n_mbs)))


@lru_cache(maxsize=4096)
def local_params(cfg: ModelConfig, tp: int, pp: int, pp_rank: int) -> int:
    """Parameters one device of pipeline stage ``pp_rank`` holds (memoized ``param_layout.shard_numel``)."""
    return shard_numel(cfg, tp, pp, pp_rank)


@lru_cache(maxsize=4096)
def local_optimizer_elems(cfg: ModelConfig, tp: int, pp: int, pp_rank: int, dp: int) -> int:
    """Elements of optimizer state (per kind: master, m, v) on a device of stage ``pp_rank``: its dp rank's
    chunk of every local tensor (``models/zero.py``; every tensor whole at dp 1)."""
    return sum(chunk_numel(s.shard_numel(tp), dp) for s in stage_param_specs(cfg, pp, pp_rank) if is_trained(cfg, s))


@lru_cache(maxsize=4096)
def optimizer_step_bytes(cfg: ModelConfig, tp: int, pp: int, pp_rank: int, dp: int = 1, grad_bytes: int = 4) -> int:
    """Peak temporaries after the backward on a device of stage ``pp_rank``, the larger of:

    - the AdamW update's fp32 temporaries (``models/optim.py``, ``models/zero.py``: torch's AdamW one tensor at
      a time, over the weights, then over the norms and biases): sqrt(v) and its bias-corrected quotient for
      the current tensor, while the previous tensor's quotient is still referenced; with dp > 1 the tensors
      are the rank's chunks, ceil(n / dp) elements, visited in name order. With gradients narrower than fp32
      (``grad_bytes`` < 4) each tensor is a step of its own (``optim.step_each``), so no previous quotient
      outlives it, and its gradient's fp32 copy joins the two temporaries;
    - with dp > 1, the distributed optimizer's flat buffer of one bucket (``zero.plan_buckets``): the
      reduce-scatter's in ``grad_bytes`` per element, the parameters' all-gather's (in the parameter dtype,
      never wider than the fp32 gradients) after it.
    """
    specs = [s for s in stage_param_specs(cfg, pp, pp_rank) if is_trained(cfg, s)]  # LoRA: the adapters
    if dp > 1:
        specs = sorted(specs, key=lambda s: s.name)
    peak = 0
    for group in ([s for s in specs if len(s.shape) >= 2], [s for s in specs if len(s.shape) < 2]):
        prev = 0
        for spec in group:
            n = chunk_numel(spec.shard_numel(tp), dp)
            peak = max(peak, 4 * (prev + 2 * n) if grad_bytes == 4 else 4 * 3 * n)
            prev = n
    if dp > 1:
        numels = [s.shard_numel(tp) for s in specs]
        for bucket in plan_buckets(numels, dp):
            peak = max(peak, grad_bytes * dp * sum(chunk_numel(numels[i], dp) for i in bucket))
    return peak


def max_local_params(cfg: ModelConfig, tp: int, pp: int) -> int:
    return max(local_params(cfg, tp, pp, k) for k in range(pp))


def param_bytes(cfg: ModelConfig, strategy: ParallelStrategy, pp_rank: int, precision: Precision) -> int:
    return local_params(cfg, strategy.tp, strategy.pp, pp_rank) * precision.param


def _train_parts(cfg: ModelConfig, strategy: ParallelStrategy, n_mbs: int, pp_rank: int,
                 precision: Precision, recompute: bool) -> tuple[float, float, float]:
    """Per token of a micro-batch: what the stage keeps for its in-flight micro-batches, what the
    block being recomputed adds, and the head's saves (0 off the last stage)."""
    t, pp = strategy.tp, strategy.pp
    lo, hi = stage_layer_ranges(cfg.n_layers, pp)[pp_rank]
    block = saved_activation_bytes_per_token(cfg, t, precision)
    kept = layer_input_bytes_per_token(cfg, precision, t) if recompute else block
    per_mb = (hi - lo) * kept + stage_saved_bytes_per_token(cfg, pp_rank == 0, precision)
    head = head_saved_bytes_per_token(cfg, t, precision) if pp_rank == pp - 1 else 0.0
    # the block being recomputed shares its input with what the stage already keeps
    redo = block - layer_input_bytes_per_token(cfg, precision, t) if recompute else 0.0
    return min(n_mbs, pp - pp_rank) * per_mb, redo, head


def train_inflight_bytes(cfg: ModelConfig, strategy: ParallelStrategy, pp_rank: int, n_tok: int,
                         precision: Precision, recompute: bool = False) -> int:
    """Bytes one in-flight micro-batch of ``n_tok`` tokens holds on a device of stage ``pp_rank`` from its forward
    to its backward (what 1F1B multiplies by min(n_mbs, pp - pp_rank)): the fused schedule's activation unit."""
    kept, _, _ = _train_parts(cfg, strategy, 1, pp_rank, precision, recompute)
    if strategy.pp > 1:
        kept += pipeline_held_bytes_per_token(cfg, precision, pp_rank == strategy.pp - 1, strategy.tp)
    return int(kept * n_tok)


def train_saved_bytes(cfg: ModelConfig, strategy: ParallelStrategy, n_mbs: int, pp_rank: int, n_tok: int,
                      precision: Precision, recompute: bool = False) -> int:
    """Peak bytes a training step keeps for its backward on a device of stage ``pp_rank`` (module docstring),
    with micro-batches of ``n_tok`` tokens: saved tensors only, what ``SavedTensorMeter`` measures."""
    kept, redo, head = _train_parts(cfg, strategy, n_mbs, pp_rank, precision, recompute)
    return int(kept * n_tok + max(head, redo) * n_tok)


def train_activation_bytes(cfg: ModelConfig, strategy: ParallelStrategy, n_mbs: int, pp_rank: int, n_tok: int,
                           precision: Precision, recompute: bool = False, masks: int = 0) -> int:
    """Peak dynamic bytes of a training step on a device of stage ``pp_rank``, temporaries included (module
    docstring). In the forward and backward: the kept micro-batches (and what 1F1B holds for them) plus the
    largest of one block at work (with one weight's gradient in the compute dtype before it joins the fp32
    main_grad), the head at work on the last stage, and the embedding's gradient on the first. After them:
    the optimizer update's temporaries. ``masks``: the explicit attention masks' bytes (``mask_memory.py``), held
    in the forward and backward."""
    t, pp = strategy.tp, strategy.pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    kept, redo, _ = _train_parts(cfg, strategy, n_mbs, pp_rank, precision, recompute)
    if pp > 1:
        kept += min(n_mbs, pp - pp_rank) * pipeline_held_bytes_per_token(cfg, precision, last, t)
    h, e = cfg.hidden_size, precision.param
    # LoRA: the frozen weights get no gradient (an adapter's r-wide one is negligible)
    weight_grad = h * max(h, cfg.q_dim, cfg.intermediate_size) / t * e if cfg.lora is None else 0.0
    work = (redo + block_backward_bytes_per_token(cfg, t, precision, recompute)) * n_tok + weight_grad
    if last:
        head = norm_saved_bytes_per_token(cfg, precision, t) * n_tok + logprob_peak_bytes(cfg, t, precision, True,
                                                                                         n_tok)
        work = max(work, head)
    if first and cfg.lora is None:
        work = max(work, cfg.padded_vocab_size / t * h * e)  # the embedding's gradient, after the blocks' backward
    return int(max(kept * n_tok + work + masks, optimizer_step_bytes(cfg, t, pp, pp_rank, strategy.dp,
                                                                     precision.grad)))


def stage_call_memory(cfg: ModelConfig, work: Workload, strategy: ParallelStrategy, n_mbs: int, pp_rank: int,
                      precision: Precision, recompute: bool = False, gen_in_flight: int | None = None) -> CallMemory:
    """Memory of one call on a device of pipeline stage ``pp_rank``, counting its layout's parameters;
    ``recompute`` (training only) recomputes activations; ``gen_in_flight`` (GENERATE with pp > 1) is
    generation's ``max_in_flight``, pp by default (module docstring)."""
    t, pp = strategy.tp, strategy.pp
    lo, hi = stage_layer_ranges(cfg.n_layers, pp)[pp_rank]
    n_blocks = hi - lo
    last = pp_rank == pp - 1
    n_param = local_params(cfg, t, pp, pp_rank)
    b = work.micro_batch(strategy.dp, n_mbs)
    block = transient_activation_bytes_per_token(cfg, t, precision) + rope_bytes_per_token(cfg, precision)
    params = n_param * precision.param
    in_flight = min(n_mbs, pp - pp_rank) if work.interface is InterfaceType.TRAIN_STEP else 1
    masks = stage_mask_bytes(cfg, work.interface, b, work.prompt_len, work.packed(b), precision, n_blocks, in_flight,
                             recompute, first_layer=lo)
    if work.interface is InterfaceType.TRAIN_STEP:
        act = train_activation_bytes(cfg, strategy, n_mbs, pp_rank, b * work.seq_len, precision, recompute, masks)
        optimizer = local_optimizer_elems(cfg, t, pp, pp_rank, strategy.dp) * precision.optimizer
        # gradients and optimizer state of the trained parameters only (LoRA: the adapters; lora_config.py)
        grads = trained_shard_numel(cfg, t, pp, pp_rank) * precision.grad
        return CallMemory(params=params, grads=grads, optimizer=optimizer, activations=act)
    if work.interface is InterfaceType.INFERENCE:
        # a stage's output (its n/t tokens, sequence parallel) stays referenced by its send until the next
        # stage has received it
        sent = cfg.hidden_size * precision.param / t if not last else 0.0
        n_tok = b * work.seq_len
        head = logprob_peak_bytes(cfg, t, precision, False, n_tok) if last else 0.0
        return CallMemory(params=params, activations=int(max(block * n_tok + masks, head) + sent * n_tok))
    # GENERATE: the micro-batches in flight hold a KV cache each and, before the last stage, their prefill's
    # output until the next stage has received it (models/generation.py)
    in_flight = 1 if pp == 1 else min(n_mbs, gen_in_flight or pp)
    kv = in_flight * b * work.seq_len * n_blocks * kv_cache_bytes_per_token_layer(cfg, t, precision)
    sent = 0.0 if last else in_flight * b * work.prompt_len * cfg.hidden_size * precision.param
    sampling = b * sampling_bytes_per_row(cfg) if last and not cfg.is_critic else 0.0
    # generation runs without sequence parallelism
    prefill = transient_activation_bytes_per_token(cfg, t, precision, sequence_parallel=False)
    act = max((prefill + rope_bytes_per_token(cfg, precision)) * b * work.prompt_len + masks, sampling) + sent
    return CallMemory(params=params, activations=int(act), kv_cache=int(kv))


def call_memory(cfg: ModelConfig | None, work: Workload, strategy: ParallelStrategy, n_mbs: int,
                precision: Precision, recompute: bool = False) -> CallMemory:
    """The most loaded device of the call's layout: the stage with the largest total."""
    if cfg is None:
        return CallMemory()
    stages = [stage_call_memory(cfg, work, strategy, n_mbs, k, precision, recompute) for k in range(strategy.pp)]
    return max(stages, key=lambda m: m.total)
