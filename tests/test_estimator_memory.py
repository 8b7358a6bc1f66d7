"""Memory per device (realhf.txt Table 2) against hand-computed byte counts (issue 3)."""

import dataclasses

import pytest

from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto, experiment_spec
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan
from realloc.strategy import ParallelStrategy as S
from spec_helpers import COST_ONLY_INTERFACES

# tiny: vocab 64, hidden 64, MLP 176, 4 layers, 4 heads, 4 KV heads (kv_dim 64); fp32 on "cpu".
V, H, I, L = 64, 64, 176, 4
LAYER_TP2 = (4 * H * H + 3 * H * I) // 2 + 2 * H  # q,k,v,o and gate,up,down split in two; 2 norms replicated
STAGE0_TP2_PP2 = V * H // 2 + 2 * LAYER_TP2  # embedding shard + layers 0, 1
STAGE1_TP2_PP2 = 2 * LAYER_TP2 + H + V * H // 2  # layers 2, 3 + final norm + lm_head shard
FULL = V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H + V * H


@auto(nodelist="localhost", n_devices_per_node=4, device="cpu", batch_size=16, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class FourDevices:
    @property
    def rpcs(self):
        return [
            ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type="tiny", interface_type=GENERATE,
                                 interface_impl="gen_seq", input_data=["prompts"], output_data=["seq"]),
            ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type="tiny", interface_type=INFERENCE,
                                 interface_impl="ppo_actor", input_data=["seq"], output_data=["ref_logp"]),
            ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                 interface_impl="train_on_ref", input_data=["seq", "ref_logp"], n_minibatches=2),
        ]

    interfaces = COST_ONLY_INTERFACES


@pytest.fixture(scope="module")
def model():
    return CostModel(build_graph(experiment_spec(FourDevices)), discover=False)


def test_parameter_counts_by_hand():
    assert FULL == 209472
    assert STAGE0_TP2_PP2 == 52480 and STAGE1_TP2_PP2 == 52544


def test_train_memory_tp2_pp2(model):
    mesh = model.cluster.whole
    s = S(1, 2, 2)
    stages = model._stage_memory("actor_train", s, 2)
    # 16 sequences / 2 mini-batches = 8 per step; dp 1, 2 micro-batches -> b = 4 sequences of 16 tokens
    n_tok = 4 * 16
    # per block and token (opcount.saved_activation_bytes_per_token), sequence parallel at tp 2: two lean RMSNorms
    # keeping their input and 1/rms (fp32), and their output the projections keep ((2 * 4) * H + 4 each), all of
    # the rank's half of the tokens (the projections keep the output before their all-gather); attention's q, k, v
    # (GQA-repeated) and output (4 * H / 2 elements) and its log-sum-exp (4 heads / 2 fp32); the MLP's gate, up,
    # SwiGLU and product (4 * I / 2)
    norm = (8 * H + 4) // 2
    saved_per_token = 2 * norm + 4 * H // 2 * 4 + 4 // 2 * 4 + 4 * I // 2 * 4
    assert saved_per_token == 2444  # 2960 without sequence parallelism (norms 8 * H + 4)
    rope = 2 * 16 * 4  # cos and sin of the 16-dim heads, once per stage and micro-batch
    # at work on top of the kept micro-batches (opcount.block_backward_bytes_per_token): the largest of the
    # no-grad working set (stage input, block input, residual, norm output: 4 H over half the tokens; then SwiGLU,
    # up, product: 3 I / 2, more than the gathered norm output H with gate and up, or the down projection's
    # product, partial output H and its half H / 2), a projection's backward (its input gathered again and the
    # input's gradient, 2 H, with gate's and up's gradients, 2 I / 2) and the RMSNorm backward's fp32 H-wide
    # buffer (its input's gradient in fp32) plus its output's gradient, over half the tokens
    block_work = max((4 * H // 2 + max(H + 2 * I // 2, 3 * I // 2, I // 2 + H + H // 2)) * 4,
                     (2 * H + 2 * I // 2) * 4, (4 + 4) * H // 2)
    assert block_work == 1568
    weight_grad = H * I // 2 * 4  # gate, up or down's gradient before it joins main_grad
    # 1F1B: stage 0 holds min(2, pp - 0) = 2 micro-batches (and their int64 token ids) and each one's
    # output until its gradient arrives (H per token of its half); stage 1 holds 1 and receives fp32 inputs that
    # its first norm saves as they are. The last stage's head peaks in the chunked log-prob's backward: the
    # saved V/2 logits and their gradient (fp32 here), 25 bytes of per-token scalars, and one fp32 block of
    # all 64 tokens (the chunk is 2**24 / 32 tokens; the LM head all-gathers the tokens, so the log-prob's
    # terms are not split), on top of the final norm's saves (half the tokens); the blocks' work is larger here.
    act0 = 2 * (saved_per_token * 2 + rope + 8 + H * 4 // 2) * n_tok + block_work * n_tok + weight_grad
    head = norm + 2 * (V // 2) * 4 + 25 + (V // 2) * 4
    act1 = 1 * (saved_per_token * 2 + rope) * n_tok + max(block_work * n_tok + weight_grad, head * n_tok)
    assert (act0, act1) == (782336, 443904)  # (963584, 542720) without sequence parallelism
    assert stages[0].params == STAGE0_TP2_PP2 * 4 and stages[1].params == STAGE1_TP2_PP2 * 4
    assert stages[0].grads == STAGE0_TP2_PP2 * 4 and stages[0].optimizer == STAGE0_TP2_PP2 * 8
    assert stages[0].activations == act0 and stages[1].activations == act1
    assert stages[0].kv_cache == 0
    worst = model.call_memory("actor_train", mesh, s, 2)
    assert worst == max(stages, key=lambda m: m.total)
    # recomputation: each block keeps its input (H per token of the rank's half); the block being recomputed
    # holds its saved set minus that input, and on top of it the largest of: the MLP backward's gradients of its
    # three I / 2 wide tensors beside the recomputed output and its gradient (H / 2 each), attention's moments
    # (rotary's q, three temporaries, k, v: 6 * H / 2; the o projection's q, k, v, output, partial H-wide result
    # and its half: 4 * H / 2 + H + H / 2, larger), the norm's backward (its buffer, its output's gradient, the
    # recomputed output and residual, over half the tokens) and a projection's re-gather (2 H + 2 I / 2)
    redo = model._stage_memory("actor_train", s, 2, recompute=True)
    redo_work = (saved_per_token - H * 4 // 2) + max((3 * I // 2 + 2 * H // 2) * 4, (4 * H // 2 + H + H // 2) * 4,
                                                     (4 + 3 * 4) * H // 2, (2 * H + 2 * I // 2) * 4)
    assert redo_work == 2316 + 1312  # the MLP's backward is the largest
    assert redo[0].activations == 2 * (H * 4 // 2 * 2 + rope + 8 + H * 4 // 2) * n_tok + redo_work * n_tok + weight_grad
    assert redo[1].activations == (H * 4 // 2 * 2 + rope) * n_tok + redo_work * n_tok + weight_grad
    assert redo[0].params == stages[0].params and redo[0].optimizer == stages[0].optimizer


def test_optimizer_update_temporaries_by_hand_and_measured():
    """memory.optimizer_step_bytes against a hand count and against the bytes MasterWeightAdamW allocates."""
    import torch

    from realloc.estimator.memory import optimizer_step_bytes
    from realloc.models.activations import LiveTensorMeter
    from realloc.models.config import get_model_config
    from realloc.models.optim import MasterWeightAdamW
    from realloc.models.param_layout import stage_param_specs

    cfg = get_model_config("tiny")
    # stage 1 of (tp 2, pp 2): per layer q, k, v, o (H/2 x H) and gate, up, down (I/2 x H), then lm_head
    # (V/2 x H). Updating up (or down) allocates sqrt(v) and its quotient while gate's quotient lives.
    gate = I // 2 * H
    assert optimizer_step_bytes(cfg, 2, 2, 1) == 4 * (gate + 2 * gate) == 67584
    specs = stage_param_specs(cfg, 2, 1)
    params = {s.name: torch.nn.Parameter(torch.randn(s.shard_shape(2)).bfloat16()) for s in specs}
    opt = MasterWeightAdamW(params, lr=1e-3, weight_decay=0.1)
    grads = {n: torch.randn(p.shape) for n, p in params.items()}
    opt.step_with(grads)  # creates the Adam state (static optimizer memory)
    with LiveTensorMeter() as meter:
        opt.step_with(grads)
    assert 0 <= meter.peak - 67584 <= 64, meter.peak  # plus a few scalars


def test_generate_and_inference_memory(model):
    mesh = model.cluster.whole
    gen = model._stage_memory("actor_gen", S(1, 2, 2), 2)
    # 16 prompts, 2 micro-batches of 8 pipelined through 2 stages (pp = 2 in flight): both KV caches are alive,
    # 16 seqs x 16 positions x 2 layers x (K and V of 64/2 dims) x 4 bytes
    assert gen[0].kv_cache == 16 * 16 * 2 * 2 * (H // 2) * 4
    assert gen[1].kv_cache == gen[0].kv_cache
    # without a pipeline the micro-batches generate one after another: one cache of 8 sequences
    one_stage = model._stage_memory("actor_gen", S(1, 2, 1), 2)
    assert one_stage[0].kv_cache == 8 * 16 * 4 * 2 * (H // 2) * 4
    assert gen[0].grads == gen[0].optimizer == 0
    # the prefill's working set for 8 prompts of 8 tokens (block at tp 2, no sequence parallelism in generation,
    # and the rotary tables); the last
    # stage samples afterwards from 34 bytes per vocabulary entry and sequence (opcount.sampling_bytes_per_row)
    prefill = ((4 * H + 3 * I // 2) * 4 + 2 * 16 * 4) * 8 * 8
    # and its left-padding mask, [8, 1, 8, 8] bool, with one layer's fp32 copy of it (estimator/mask_memory.py)
    prefill += 8 * 8 * 8 * (1 + 4)
    # stage 0 also holds both micro-batches' prefill outputs (8 prompts x 8 tokens x H) until stage 1 has them
    assert gen[0].activations == prefill + 2 * 8 * 8 * H * 4
    assert gen[1].activations == max(prefill, 8 * 34 * V)
    inf = model.call_memory("ref_inf", mesh, S(4, 1, 1), 1)
    n_tok = 4 * 16
    assert inf.params == FULL * 4
    # the larger of a block's working set (with the rotary tables) and the log-prob's: the fp32 logits,
    # 16 bytes of per-token scalars and one fp32 block of all 64 tokens
    assert inf.activations == max((4 * H + 3 * I) * 4 + 2 * 16 * 4, V * 4 + 16 + V * 4) * n_tok
    # pp 2: stage 0's previous output stays referenced by its send
    inf2 = model._stage_memory("ref_inf", S(2, 1, 2), 1)
    assert inf2[0].activations == ((4 * H + 3 * I) * 4 + 2 * 16 * 4 + H * 4) * 8 * 16


def _plan(model, offload=False):
    g = model.graph
    c = model.cluster
    return ExecutionPlan(experiment=g.spec.name, graph_digest=g.digest, nodelist=c.nodelist,
                         n_devices_per_node=c.n_devices_per_node, device=c.device,
                         placements={"actor_train": CallPlacement(mesh="localhost", dp=2, tp=2, pp=1, n_mbs=1),
                                     "actor_gen": CallPlacement(mesh="localhost:0-1", dp=1, tp=2, pp=1, n_mbs=2),
                                     "ref_inf": CallPlacement(mesh="localhost:2-3", dp=2, tp=1, pp=1, n_mbs=1)},
                         offload={"ref": True} if offload else {})


def test_plan_memory_applies_the_rules(model):
    mesh = model.cluster.whole
    train = model.call_memory("actor_train", mesh, S(2, 2, 1), 1)
    gen = model.call_memory("actor_gen", model.cluster.mesh("localhost:0-1"), S(1, 2, 1), 2)
    ref = model.call_memory("ref_inf", model.cluster.mesh("localhost:2-3"), S(2, 1, 1), 1)
    tp2_full = L * LAYER_TP2 + V * H // 2 + H + V * H // 2
    assert train.params == tp2_full * 4 and ref.params == FULL * 4
    # trainable: params + Adam state stay, on all 4 devices; at dp 2 the distributed optimizer holds half of
    # the Adam state (m and v, fp32) on each dp rank (every tensor here has an even number of elements); the
    # fp32 gradient buffers exist only while the train step runs (its dynamic memory)
    static_actor = tp2_full * (4 + 8 // 2)
    train_dyn = train.activations + tp2_full * 4
    assert train.grads == tp2_full * 4
    peak = model.plan_memory(_plan(model))
    # devices 0, 1: the generation layout (tp2 on 2 devices) differs from the training layout
    # (dp2 x tp2 on 4), so generation runs on a reallocated copy that exists only while it runs
    gen_dyn = gen.activations + gen.kv_cache + gen.params
    assert peak[0] == peak[1] == static_actor + max(train_dyn, gen_dyn)
    # devices 2, 3: the frozen ref model lives there (its home layout), static
    assert peak[2] == peak[3] == static_actor + ref.params + max(train_dyn, ref.activations)
    # offloading ref turns its parameters into a copy loaded only while ref_inf runs
    off = model.plan_memory(_plan(model, offload=True))
    assert off[0] == peak[0]
    assert off[2] == static_actor + max(train_dyn, ref.activations + ref.params)


def test_llama3_70b_per_token_counts_by_hand():
    """The per-token byte counts behind the 70B weak-scaling plans (docs/performance.md), at tp 8 in bf16."""
    from realloc.estimator import opcount as oc
    from realloc.estimator.hardware import Precision
    from realloc.models.config import get_model_config

    cfg, bf16 = get_model_config("llama3-70b"), Precision.for_dtype("bf16")
    h, v = 8192, 128256 // 8
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (h, 28672, 128256)  # appendix Table 1
    # a block keeps two lean norms (bf16 input, fp32 1/rms, bf16 output: 4h + 4 each), sequence parallel: of the
    # rank's 1/8 of the tokens ((4h + 4) / 8; the projections gather the output again in their backward);
    # attention's q, k, v, output (h/8 each, bf16) and log-sum-exp (8 local heads, fp32), the MLP's four inter/8
    # tensors
    norms = 2 * (4 * h + 4) / 8
    assert oc.saved_activation_bytes_per_token(cfg, 8, bf16) == norms + 4 * h // 8 * 2 + 8 * 4 + 4 * 3584 * 2 == 45089
    # without sequence parallelism the norms are whole on every rank (102440); the unfused norm's fp32 input and
    # bf16 product made them 8h + 4 each (167976 a block without sequence parallelism, 53281 with it)
    assert 2 * (4 * h + 4) + 4 * h // 8 * 2 + 8 * 4 + 4 * 3584 * 2 == 102440
    assert 2 * (8 * h + 4) + 4 * h // 8 * 2 + 8 * 4 + 4 * 3584 * 2 == 167976
    # kept per block with recomputation: the layer input of the rank's 1/8 of the tokens (2h without)
    assert oc.layer_input_bytes_per_token(cfg, bf16, 8) == 2 * h / 8 == 2048
    # log-prob over the 16032-entry vocabulary shard, chunked (issue 21): inference holds the bf16 logits, 16
    # bytes of per-token scalars and one fp32 block of 2**24 // 16032 = 1046 tokens; training's backward the
    # saved bf16 logits, their bf16 gradient, 25 bytes of scalars and the block. Unchunked it was 14 and 16
    # bytes per entry: v * (2 + 4 + 4 + 4) = 224448 and v * 16 = 256512 per token. The LM head all-gathers the
    # tokens (sequence parallel) before its projection, so these hold every token of the micro-batch.
    n = 8192  # tokens of a micro-batch
    block = 1046 * v * 4
    assert oc.logprob_peak_bytes(cfg, 8, bf16, False, n) == n * (2 * v + 16) + block
    assert oc.logprob_peak_bytes(cfg, 8, bf16, True, n) == n * (4 * v + 25) + block
    assert oc.logprob_peak_bytes(cfg, 8, bf16, True, 100) == 100 * (4 * v + 25 + 4 * v)  # a chunk of all of them
    assert (n * 224448) / oc.logprob_peak_bytes(cfg, 8, bf16, False, n) > 5.5
    assert (n * 256512) / oc.logprob_peak_bytes(cfg, 8, bf16, True, n) > 3.5
    # the head keeps the final lean norm (1/8 of the tokens), the bf16 logits, the int64 target and fp32 log Z
    assert oc.head_saved_bytes_per_token(cfg, 8, bf16) == norms / 2 + 2 * v + 12
    # a block at work (sequence parallel): no-grad working set, 4h/8 + the gathered norm output h with gate and
    # up (2 inter/8) in bf16, at the MLP (attention's 3h/8 + 4 q/8 + h + h/8 at its o projection is smaller);
    # the backward of gate and up, which gathers their input again beside its gradient (2h) and theirs
    # (2 inter/8), is larger; so is either against the lean norm's backward over 1/8 of the tokens (bf16 output
    # gradient, fp32 buffer, bf16 input gradient: 8h / 8; with the recomputed output and residual 12h / 8), the
    # MLP backward's 3 inter/8 + 2h/8 and attention's moments when recomputing
    assert oc.attention_working_bytes_per_token(cfg, 8, bf16) == (3 * h / 8 + 4 * 1024 + h + h / 8) * 2 == 32768
    assert oc.transient_activation_bytes_per_token(cfg, 8, bf16) == (4 * h / 8 + h + 2 * 3584) * 2 == 38912
    assert oc.block_backward_bytes_per_token(cfg, 8, bf16, recompute=False) == (2 * h + 2 * 3584) * 2 == 47104
    assert oc.block_backward_bytes_per_token(cfg, 8, bf16, recompute=True) == 47104 > max(
        (4 + 2 + 6) * h / 8, (3 * 3584 + 2 * h / 8) * 2, (4 * 1024 + h + h / 8) * 2)
    # generation's prefill runs without sequence parallelism: every tp rank holds all tokens h wide
    assert oc.transient_activation_bytes_per_token(cfg, 8, bf16, sequence_parallel=False) == (4 * h + 3 * 3584) * 2
    assert oc.sampling_bytes_per_row(cfg) == 34 * 128256
    critic = get_model_config("llama3-8b-critic")
    assert oc.logprob_peak_bytes(critic, 8, bf16, True, n) == 0.0


def test_a_wide_query_narrow_mlp_block_peaks_in_attention_by_hand():
    """Queries twice the model's width over an MLP as wide as it (explicit head_dim): attention's working set
    is the peak (measured against the engine in test_model_train)."""
    from realloc.estimator import opcount as oc
    from realloc.estimator.hardware import Precision
    from realloc.models.config import ModelConfig

    bf16 = Precision.for_dtype("bf16")
    gqa = ModelConfig("wide-gqa", 256, 256, 256, 4, 8, 4, explicit_head_dim=64)
    mha = dataclasses.replace(gqa, n_kv_heads=8)
    # tp 2: q = 4 heads x 64 = 256 wide, k and v 2 (GQA) or 4 (MHA) heads; the stage's and block's inputs and
    # the norm's output, 3h over the rank's half of the tokens (sequence parallel); then GQA peaks at the o
    # projection (q, k and v repeated to q heads, the output, o's partial h-wide result and its half: 4q + 1.5h),
    # MHA rotating k (q + 5kv) or q (4q + 2kv): 6q
    assert oc.attention_working_bytes_per_token(gqa, 2, bf16) == (3 * 256 / 2 + 4 * 256 + 256 + 128) * 2 == 3584
    assert oc.attention_working_bytes_per_token(mha, 2, bf16) == (3 * 256 / 2 + 6 * 256) * 2 == 3840
    mlp = (4 * 256 / 2 + 256 + 2 * 128) * 2
    assert oc.transient_activation_bytes_per_token(gqa, 2, bf16) == 3584 > mlp
    # without sequence parallelism (generation's prefill) the three h-wide tensors hold every token
    assert oc.attention_working_bytes_per_token(gqa, 2, bf16, sequence_parallel=False) == (3 * 256 + 5 * 256) * 2
    # KV heads replicated at tp 8 (one 64-wide head per rank) under 1 q head per rank: q + 5kv = 6q
    assert oc.attention_working_bytes_per_token(gqa, 8, bf16) == (3 * 256 / 8 + 4 * 64 + 256 + 256 / 8) * 2
