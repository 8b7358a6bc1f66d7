"""Memory per device (realhf.txt Table 2) against hand-computed byte counts (issue 3)."""

import dataclasses

import pytest

from realloc.algorithms.ppo_config import PPOConfig
from realloc.algorithms.registry import Interface
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto, experiment_spec
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan
from realloc.strategy import ParallelStrategy as S

# tiny: vocab 64, hidden 64, MLP 176, 4 layers, 4 heads, 4 KV heads (kv_dim 64); fp32 on "cpu".
V, H, I, L = 64, 64, 176, 4
LAYER_TP2 = (4 * H * H + 3 * H * I) // 2 + 2 * H  # q,k,v,o and gate,up,down split in two; 2 norms replicated
STAGE0_TP2_PP2 = V * H // 2 + 2 * LAYER_TP2  # embedding shard + layers 0, 1
STAGE1_TP2_PP2 = 2 * LAYER_TP2 + H + V * H // 2  # layers 2, 3 + final norm + lm_head shard
FULL = V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H + V * H


# What these cost fixtures' calls run: only their shapes matter (nothing is executed).
COST_ONLY_INTERFACES = [
    Interface("gen_seq", GENERATE, "realloc.algorithms.common:actor_generate", inputs=("prompts",), outputs=("seq",),
              config="ppo", config_type=PPOConfig),
    Interface("train_on_ref", TRAIN_STEP, "realloc.algorithms.ppo_interfaces:actor_train",
              inputs=("seq", "ref_logp:logp"), config="ppo", config_type=PPOConfig),
]

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
    # per block and token (opcount.saved_activation_bytes_per_token): two RMSNorms keeping input,
    # 1/rms (fp32), product and output ((4 + 2 * 4) * H + 4 each); attention's q, k, v (GQA-repeated)
    # and output (4 * H / 2 elements) and its log-sum-exp (4 heads / 2 fp32); the MLP's gate, up,
    # SwiGLU and product (4 * I / 2)
    norm = 12 * H + 4
    saved_per_token = 2 * norm + 4 * H // 2 * 4 + 4 // 2 * 4 + 4 * I // 2 * 4
    assert saved_per_token == 3472
    rope = 2 * 16 * 4  # cos and sin of the 16-dim heads, once per stage and micro-batch
    transient = (2 * H + (H + 2 * H) // 2 + 3 * I // 2) * 4 * n_tok
    # 1F1B: stage 0 holds min(2, pp - 0) = 2 micro-batches (and their int64 token ids), stage 1 holds 1
    # and its head: the final norm, the fp32 logits and their log-softmax (V/tp wide)
    act0 = 2 * (saved_per_token * 2 + rope + 8) * n_tok + transient
    act1 = 1 * (saved_per_token * 2 + rope) * n_tok + (norm + 2 * (V // 2) * 4) * n_tok + transient
    assert stages[0].params == STAGE0_TP2_PP2 * 4 and stages[1].params == STAGE1_TP2_PP2 * 4
    assert stages[0].grads == STAGE0_TP2_PP2 * 4 and stages[0].optimizer == STAGE0_TP2_PP2 * 8
    assert stages[0].activations == act0 and stages[1].activations == act1
    assert stages[0].kv_cache == 0
    worst = model.call_memory("actor_train", mesh, s, 2)
    assert worst == max(stages, key=lambda m: m.total)
    # recomputation: each block keeps its input (H per token); the block being recomputed holds its
    # saved set minus that input, which on stage 1 outweighs the head's saves (freed by then)
    redo = model._stage_memory("actor_train", s, 2, recompute=True)
    assert redo[0].activations == 2 * (H * 4 * 2 + rope + 8) * n_tok + (saved_per_token - H * 4) * n_tok + transient
    assert redo[1].activations == (H * 4 * 2 + rope) * n_tok + (saved_per_token - H * 4) * n_tok + transient
    assert redo[0].params == stages[0].params and redo[0].optimizer == stages[0].optimizer


def test_generate_and_inference_memory(model):
    mesh = model.cluster.whole
    gen = model._stage_memory("actor_gen", S(1, 2, 2), 2)
    # 16 prompts, 2 micro-batches of 8 pipelined through 2 stages: both KV caches are alive,
    # 16 seqs x 16 positions x 2 layers x (K and V of 64/2 dims) x 4 bytes
    assert gen[0].kv_cache == 16 * 16 * 2 * 2 * (H // 2) * 4
    assert gen[1].kv_cache == gen[0].kv_cache
    # without a pipeline the micro-batches generate one after another: one cache of 8 sequences
    one_stage = model._stage_memory("actor_gen", S(1, 2, 1), 2)
    assert one_stage[0].kv_cache == 8 * 16 * 4 * 2 * (H // 2) * 4
    assert gen[0].grads == gen[0].optimizer == 0
    # last stage also holds one full-vocabulary fp32 logit row per sequence for sampling
    assert gen[1].activations - gen[0].activations == 8 * V * 4
    inf = model.call_memory("ref_inf", mesh, S(4, 1, 1), 1)
    n_tok = 4 * 16
    assert inf.params == FULL * 4
    assert inf.activations == (2 * H + 3 * H + 3 * I) * 4 * n_tok + 2 * n_tok * V * 4


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
    static_actor = tp2_full * (4 + 4 + 8)  # trainable: params + grads + Adam state, on all 4 devices
    peak = model.plan_memory(_plan(model))
    # devices 0, 1: the generation layout (tp2 on 2 devices) differs from the training layout
    # (dp2 x tp2 on 4), so generation runs on a reallocated copy that exists only while it runs
    gen_dyn = gen.activations + gen.kv_cache + gen.params
    assert peak[0] == peak[1] == static_actor + max(train.activations, gen_dyn)
    # devices 2, 3: the frozen ref model lives there (its home layout), static
    assert peak[2] == peak[3] == static_actor + ref.params + max(train.activations, ref.activations)
    # offloading ref turns its parameters into a copy loaded only while ref_inf runs
    off = model.plan_memory(_plan(model, offload=True))
    assert off[0] == peak[0]
    assert off[2] == static_actor + max(train.activations, ref.activations + ref.params)
