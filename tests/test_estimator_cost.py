"""Call time, reallocation and data-transfer cost against hand formulas (issue 3)."""

import dataclasses
import math
import re

import pytest

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto, experiment_spec, load_experiment
from realloc.estimator.call_time import (GRAD_BUCKET_NUMEL, CallCost, StageTime, decode_round, pipeline_makespan,
                                         sum_over_range)
from realloc.estimator.comm import Link, bus_factor, group_links
from realloc.estimator.cost import CostModel
from realloc.estimator.memory import local_optimizer_elems, local_params
from realloc.estimator.opcount import Part, Phase, op_work
from realloc.estimator.transfer_cost import BUCKET_BYTES, DIRECT_BYTES, plan_seconds
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.transfer_plan import Layout, plan_param_realloc
from realloc.models.config import get_model_config
from realloc.overrides import apply_overrides
from realloc.strategy import ParallelStrategy as S
from spec_helpers import COST_ONLY_INTERFACES

TINY_PARAMS = 209472  # tests/test_estimator_memory.py derives it by hand


@auto(nodelist="n[1-2]", n_devices_per_node=1, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TwoNodes:
    @property
    def rpcs(self):
        return [
            ModelFunctionCallDef(name="gen", model_name="actor", model_type="tiny", interface_type=GENERATE,
                                 interface_impl="gen_seq", input_data=["prompts"], output_data=["seq"]),
            ModelFunctionCallDef(name="ref", model_name="ref", model_type="tiny", interface_type=INFERENCE,
                                 interface_impl="ppo_actor", input_data=["seq"], output_data=["ref_logp"]),
            ModelFunctionCallDef(name="train", model_name="actor", interface_type=TRAIN_STEP,
                                 interface_impl="train_on_ref", input_data=["seq", "ref_logp"], n_minibatches=2),
        ]

    interfaces = COST_ONLY_INTERFACES


@auto(nodelist="n1", n_devices_per_node=2, device="a100-80g", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class GpuPair:
    """TwoNodes' calls on two bf16 GPUs of one node, with the train call's settings as a field."""

    ppo: PPOConfig = PPOConfig(n_minibatches=2)  # as the train call says
    rpcs = TwoNodes.rpcs
    interfaces = COST_ONLY_INTERFACES


@pytest.fixture(scope="module")
def two_nodes():
    return CostModel(build_graph(experiment_spec(TwoNodes)), discover=False)


@pytest.fixture(scope="module")
def tiny():
    return CostModel(build_graph(load_experiment("experiments/ppo_tiny.py")), discover=False)


@pytest.fixture(scope="module")
def big():
    return CostModel(build_graph(load_experiment("experiments/ppo_7b_7b.py")))


def test_identical_layouts_cost_nothing(two_nodes):
    m = two_nodes.cluster.mesh("n1")
    assert two_nodes.realloc_cost("actor", (m, S(1, 1, 1)), (m, S(1, 1, 1))) == 0.0
    # the consumer already holds what the producer made on the same device
    assert two_nodes.data_transfer_cost("gen", "ref", (m, S(1, 1, 1)), (m, S(1, 1, 1))) == 0.0
    # calls with no key in common move nothing
    assert two_nodes.data_transfer_cost("ref", "gen", (m, S(1, 1, 1)), (two_nodes.cluster.mesh("n2"), S(1, 1, 1))) == 0


def test_disjoint_layouts_move_every_byte_over_the_link(two_nodes):
    hw, cl = two_nodes.hw, two_nodes.cluster
    a, b = cl.mesh("n1"), cl.mesh("n2")
    nbytes = TINY_PARAMS * 4
    # every tiny tensor is below DIRECT_BYTES, so all of it is one bucketed p2p message over the inter-node
    # link; plus the workers' handling of the one request
    want = hw.inter_node_latency + nbytes / (cl.inter_node_bandwidth * hw.comm_efficiency) + hw.call_overhead
    assert two_nodes.realloc_cost("actor", (a, S(1, 1, 1)), (b, S(1, 1, 1))) == pytest.approx(want)
    # the data: 8 sequences x 16 tokens x 8 bytes of "seq", one request
    want = hw.inter_node_latency + 8 * 16 * 8 / (cl.inter_node_bandwidth * hw.comm_efficiency) + hw.call_overhead
    assert two_nodes.data_transfer_cost("gen", "ref", (a, S(1, 1, 1)), (b, S(1, 1, 1))) == pytest.approx(want)


def test_reallocation_to_parameters_a_device_holds_costs_a_local_copy(tiny):
    # dp=2 on both devices -> device 0 alone: device 0 copies its own replica into the new layout, no message
    hw, cl = tiny.hw, tiny.cluster
    want = TINY_PARAMS * 4 / (hw.memory_bandwidth * hw.memory_efficiency) + hw.call_overhead
    got = tiny.realloc_cost("actor", (cl.whole, S(2, 1, 1)), (cl.mesh("localhost:0"), S(1, 1, 1)))
    assert got == pytest.approx(want)
    # the other way, device 1 receives the whole model while device 0 copies its own: the message is slower
    msg = hw.intra_node_latency + TINY_PARAMS * 4 / (cl.intra_node_bandwidth * hw.comm_efficiency)
    got = tiny.realloc_cost("actor", (cl.mesh("localhost:0"), S(1, 1, 1)), (cl.whole, S(2, 1, 1)))
    assert got == pytest.approx(max(msg, want - hw.call_overhead) + hw.call_overhead)


def test_plan_seconds_counts_every_message_of_the_plan(big):
    """The class-template walk agrees with the expanded transfer list of a 7B reallocation."""
    cl = big.cluster
    src = Layout(cl.whole, S(2, 8, 1))
    dst = Layout(cl.mesh("trainer01:0-3"), S(1, 2, 2))
    plan = plan_param_realloc(get_model_config("llama3-8b"), src, dst, bytes_per_element=2, devices_per_node=8)
    busy = {}
    groups = {}
    for t in plan.transfers:
        if t.nbytes >= DIRECT_BYTES:
            link = Link.INTER if any(d // 8 != t.src // 8 for d in t.dsts) else Link.INTRA
            sec = big.comm.time("p2p" if len(t.dsts) == 1 else "broadcast", len(t.dsts) + 1, t.nbytes, link)
            for d in (t.src, *t.dsts):
                busy[d] = busy.get(d, 0.0) + sec
        else:
            groups[t.src, t.dsts] = groups.get((t.src, t.dsts), 0) + t.nbytes
    for (src_dev, dsts), total in groups.items():
        n = max(1, math.ceil(total / BUCKET_BYTES))
        link = Link.INTER if any(d // 8 != src_dev // 8 for d in dsts) else Link.INTRA
        sec = n * big.comm.time("p2p" if len(dsts) == 1 else "broadcast", len(dsts) + 1, total / n, link)
        for d in (src_dev, *dsts):
            busy[d] = busy.get(d, 0.0) + sec
    assert plan_seconds(plan, big.comm, 8) == pytest.approx(max(busy.values()))
    # destination elements not received are copied locally, overlapping the messages
    cfg, hw = get_model_config("llama3-8b"), big.hw
    copies = [(local_params(cfg, 2, 2, S(1, 2, 2).coords(r)[2]) * 2 - plan.received_bytes.get(d, 0))
              / (hw.memory_bandwidth * hw.memory_efficiency) for r, d in enumerate(dst.mesh.device_ids)]
    assert big.realloc_cost("actor", (cl.whole, S(2, 8, 1)), (cl.mesh("trainer01:0-3"), S(1, 2, 2))) == \
        pytest.approx(max(*busy.values(), *copies) + hw.call_overhead)


def test_dp_allreduce_term(tiny):
    hw, cl = tiny.hw, tiny.cluster
    mesh = cl.whole
    cost = tiny.call_cost("actor_train", mesh, S(2, 1, 1), 1)
    # the distributed optimizer (dp 2, fp32 model): a ring reduce-scatter of the fp32 gradients and a ring
    # all-gather of the fp32 parameters, each (n-1) chunks of bytes/n over the intra-node link, once per
    # mini-batch, with the gradient norm's and the loss statistic's all-reduces (1 float64 each) ...
    bw = cl.intra_node_bandwidth * hw.comm_efficiency
    one = 2 * (hw.intra_node_latency + (2 - 1) * TINY_PARAMS / 2 * 4 / bw)
    stats = hw.intra_node_latency + 2 * (2 - 1) / 2 * 8 / bw
    # ... and once per call PPO's advantage moments and per-mini-batch token counts (3 + 2 float64s)
    moments = hw.intra_node_latency + 2 * (2 - 1) / 2 * 8 * (3 + 2) / bw
    # gradients and parameters are packed into one flat buffer and unpacked after: two copies each at memory speed
    pack = 2 * TINY_PARAMS * (4 + 4) / (hw.memory_bandwidth * hw.memory_efficiency)
    assert cost.dp_allreduce == pytest.approx(2 * (one + pack + 2 * stats) + moments)
    assert tiny.call_cost("actor_train", cl.mesh("localhost:0"), S(1, 1, 1), 1).dp_allreduce == 0.0
    assert TINY_PARAMS < GRAD_BUCKET_NUMEL


def test_pipeline_bubble_formula():
    t = StageTime(compute=3.0, tp_comm=0.5, pp_comm=0.5)
    for pp in (1, 2, 4):
        for m in (1, 2, 8):
            c = pipeline_makespan([t] * pp, m)
            assert c.time == pytest.approx((m + pp - 1) * 4.0)
            # bubble relative to useful work: (pp - 1) / m
            assert c.bubble / (c.compute + c.tp_comm + c.pp_comm) == pytest.approx((pp - 1) / m)
    uneven = [StageTime(1.0, 0, 0), StageTime(3.0, 0, 0.5), StageTime(2.0, 0, 0)]
    c = pipeline_makespan(uneven, 4)
    assert c.time == pytest.approx(1.0 + 3.5 + 2.0 + 3 * 3.5)
    assert c.compute == 12.0 and c.pp_comm == 2.0
    # pipelined decoding: 4 micro-batches keep the slowest stage busy (4 x 3.5) longer than one
    # micro-batch's trip through the stages and back (6.5 + 0.25); a single one waits for its tokens
    assert decode_round(uneven, 4, 0.25).time == pytest.approx(4 * 3.5)
    one = decode_round(uneven, 1, 0.25)
    assert one.time == pytest.approx(6.5 + 0.25) and one.bubble == pytest.approx(6.75 - 3.5)
    assert decode_round([t], 3, 0.0).time == pytest.approx(3 * 4.0)  # pp = 1: one after another


@pytest.mark.parametrize("strategy, n_mbs", [(S(1, 2, 1), 4), (S(1, 1, 2), 8), (S(2, 1, 1), 2)])
def test_recomputation_costs_one_more_forward_of_the_blocks_per_micro_batch(tiny, strategy, n_mbs):
    """Recomputing activations adds one forward of a stage's L_k blocks (compute and their 2 tp all-reduces,
    no embedding, no head) to every micro-batch on every stage; through 1F1B that is (pp + m - 1) of them
    per optimizer step (the stages are equal here: tiny's 4 layers split evenly), n_steps per call."""
    mesh = tiny.cluster.whole
    timer = tiny._timer(tiny.graph.model_config("actor_train"))
    w = tiny.workload("actor_train")
    b = w.micro_batch(strategy.dp, n_mbs)
    plain = tiny.call_cost("actor_train", mesh, strategy, n_mbs)
    redo = tiny.call_cost("actor_train", mesh, strategy, n_mbs, recompute=True)
    compute, tp_comm = timer.op(Part.BLOCK, Phase.FWD, strategy.tp, b, w.seq_len)
    layers = 4 // strategy.pp
    extra = layers * (compute + tp_comm)
    assert (tp_comm > 0) == (strategy.tp > 1)
    assert redo.time - plain.time == pytest.approx(w.n_steps * (strategy.pp + n_mbs - 1) * extra, rel=1e-9)
    # the busiest stage's own work grows by m forwards; the rest is the longer pipeline fill
    assert redo.compute - plain.compute == pytest.approx(w.n_steps * n_mbs * layers * compute, rel=1e-9)
    assert redo.tp_comm - plain.tp_comm == pytest.approx(w.n_steps * n_mbs * layers * tp_comm, rel=1e-9, abs=1e-15)
    assert redo.bubble - plain.bubble == pytest.approx(w.n_steps * (strategy.pp - 1) * extra, rel=1e-9, abs=1e-15)
    assert w.n_steps == 2 and redo.optimizer == plain.optimizer and redo.dp_allreduce == plain.dp_allreduce


def test_breakdown_sums_to_time_and_pp_adds_a_bubble(tiny):
    mesh = tiny.cluster.whole
    for call in ("actor_gen", "ref_inf", "actor_train"):
        for s, m in ((S(1, 1, 2), 2), (S(2, 1, 1), 2), (S(1, 2, 1), 1)):
            c = tiny.call_cost(call, mesh, s, m)
            assert c.time == pytest.approx(sum(c.breakdown().values()))
            assert (c.bubble > 0) == (s.pp > 1)
            assert (c.tp_comm > 0) == (s.tp > 1)
            assert (c.pp_comm > 0) == (s.pp > 1)


def test_sum_over_range_is_exact_for_piecewise_linear():
    def f(x):
        v = 2.0 * x + 1 if x <= 37 else 75.0 + 0.5 * (x - 37)
        return CallCost.of(compute=v)

    got = sum_over_range(f, 9, 120, extra_points=(37,))
    assert got.time == pytest.approx(sum(f(x).time for x in range(9, 121)))
    assert sum_over_range(f, 5, 4).time == 0.0
    assert sum_over_range(f, 5, 5).time == pytest.approx(f(5).time)


@pytest.mark.parametrize("which", ["tiny", "big"])
def test_generation_is_prefill_plus_every_decode_step(which, tiny, big):
    model = {"tiny": tiny, "big": big}[which]
    call = "actor_gen"
    mesh = model.cluster.whole
    s = S(1, 1, 2) if which == "tiny" else S(2, 4, 2)
    cost = model.call_cost(call, mesh, s, 2)
    timer = model._timer(model.graph.model_config(call))
    links = model.links(mesh, s)
    w = model.workload(call)
    b = w.micro_batch(s.dp, 2)
    # every stage does a step's bookkeeping for each micro-batch; the last stage sends the tokens to
    # the other stages, and the first stage waits for them
    h = model.hw.decode_step_overhead
    back = model.comm.time("p2p", 2, 16 * b, links.pp_any)
    assert timer._stages(Phase.DECODE, s, links, b, 20)[-1].pp_comm == pytest.approx(back)  # pp - 1 = 1 send

    def stage_totals(phase, ctx):
        return [st.compute + st.tp_comm + st.pp_comm + h for st in timer._stages(phase, s, links, b, ctx)]

    pre = stage_totals(Phase.PREFILL, w.prompt_len)
    prefill = sum(pre) + (2 - 1) * max(pre)  # two micro-batches through the pipeline
    steps = 0.0
    for ctx in range(w.prompt_len + 1, w.seq_len):
        st = stage_totals(Phase.DECODE, ctx)
        steps += max(2 * max(st), sum(st) + back)
    assert back > 0
    assert cost.time == pytest.approx(prefill + steps + model.hw.call_overhead, rel=1e-9)


def test_group_links():
    g = group_links((2, 8), S(2, 8, 1))
    assert (g.tp, g.dp, g.pp, g.world) == (Link.INTRA, Link.INTER, (), Link.INTER)
    g = group_links((2, 8), S(4, 2, 2))
    assert (g.tp, g.dp, g.pp) == (Link.INTRA, Link.INTRA, (Link.INTER,))
    g = group_links((1, 4), S(2, 1, 2))
    assert (g.dp, g.pp, g.world) == (Link.INTRA, (Link.INTRA,), Link.INTRA)


def test_roofline_regimes_and_tp_collectives(big):
    cfg, hw = get_model_config("llama3-8b"), big.hw
    prec = hw.precision
    dec = op_work(cfg, Part.BLOCK, Phase.DECODE, 8, 64, 1536, prec)
    assert dec.gemm_bytes / hw.memory_bandwidth > dec.gemm_flops / hw.peak_flops  # decode: bandwidth-bound
    assert dec.attn_bytes / hw.memory_bandwidth > dec.attn_flops / hw.peak_flops
    fwd = op_work(cfg, Part.BLOCK, Phase.FWD, 8, 8, 2048, prec)
    assert fwd.gemm_flops / hw.peak_flops > fwd.gemm_bytes / hw.memory_bandwidth  # training: compute-bound
    # sequence parallel (whole sequences): per block forward, and again backward, two all-gathers of the rank's
    # b x s x h / tp tokens and two reduce-scatters of b x s x h partial sums, whose ring bytes are those of the
    # two all-reduces they replace; the backward gathers the projections' inputs again (two more all-gathers);
    # generation (no sequence parallelism) all-reduces; none at tp = 1
    act = 4 * 128 * 4096 * 2
    for phase, gathers in ((Phase.FWD, 2), (Phase.BWD, 4)):
        ag, rs = op_work(cfg, Part.BLOCK, phase, 8, 4, 128, prec).tp_collectives
        assert (ag.op, ag.count, ag.nbytes) == ("all_gather", gathers, act / 8)
        assert (rs.op, rs.count, rs.nbytes) == ("reduce_scatter", 2, act)
        assert bus_factor("all_gather", 8) * act / 8 + bus_factor("reduce_scatter", 8) * act == \
            pytest.approx(bus_factor("all_reduce", 8) * act) == 2 * 7 / 8 * act
    (c,) = op_work(cfg, Part.BLOCK, Phase.PREFILL, 8, 4, 128, prec).tp_collectives
    assert (c.op, c.count, c.nbytes) == ("all_reduce", 2, act)
    assert op_work(cfg, Part.BLOCK, Phase.FWD, 1, 4, 128, prec).tp_collectives == ()


def test_calls_are_cached_by_mesh_shape(big):
    cl = big.cluster
    a = big.call_cost("ref_inf", cl.mesh("trainer01:0-3"), S(1, 4, 1), 4)
    b = big.call_cost("ref_inf", cl.mesh("trainer02:4-7"), S(1, 4, 1), 4)
    assert a is b
    with pytest.raises(ValueError, match=r"call 'ref_inf': dp\*tp\*pp = 8 but mesh trainer01:0-3 has 4 devices"):
        big.call_cost("ref_inf", cl.mesh("trainer01:0-3"), S(2, 4, 1), 4)
    with pytest.raises(ValueError, match="has no call 'nope'"):
        big.call_cost("nope", cl.whole, S(2, 8, 1), 1)


def test_constants_agree_with_the_runtime():
    from realloc.models import grads
    from realloc.runtime.transfer import param_realloc

    assert GRAD_BUCKET_NUMEL == grads.BUCKET_NUMEL
    assert BUCKET_BYTES == param_realloc.DEFAULT_BUCKET_BYTES and DIRECT_BYTES == param_realloc.DEFAULT_DIRECT_BYTES


def test_data_transfer_prices_the_runtimes_own_plans(tiny):
    """Same producer/consumer stages and one plan per key as realloc.runtime.control.program."""
    from realloc.graph.plan import CallPlacement, ExecutionPlan
    from realloc.runtime.control.program import RuntimeProgram

    g, c = tiny.graph, tiny.cluster
    place = {n: CallPlacement(mesh="localhost", dp=1, tp=1, pp=2, n_mbs=1) for n in g.spec.call_names}
    place["ref_inf"] = CallPlacement(mesh="localhost:1", dp=1, tp=1, pp=1, n_mbs=1)
    place["actor_train"] = CallPlacement(mesh="localhost", dp=2, tp=1, pp=1, n_mbs=1)
    place["rew_inf"] = CallPlacement(mesh="localhost", dp=2, tp=1, pp=1, n_mbs=1)  # a rule: data-parallel only
    plan = ExecutionPlan(experiment=g.spec.name, graph_digest=g.digest, nodelist=c.nodelist,
                         n_devices_per_node=c.n_devices_per_node, device=c.device, placements=place)
    prog = RuntimeProgram(g, plan)
    row = g.spec.seq_len * 8
    lay = {n: (c.mesh(p.mesh), p.strategy) for n, p in place.items()}
    got = {}
    for src, dst in (("actor_gen", "ref_inf"), ("actor_gen", "actor_train"), ("ref_inf", "actor_train"),
                     ("critic_inf", "actor_train")):
        keys = tiny.transferred_keys(src, dst)
        assert keys
        plans = [prog.data_plan(k, dst, row) for k in keys]
        # one request per key that moves anything (the master sends none for an empty plan)
        want = sum(plan_seconds(p, tiny.comm, c.n_devices_per_node) + tiny.hw.call_overhead
                   for p in plans if not p.empty)
        got[src, dst] = tiny.data_transfer_cost(src, dst, lay[src], lay[dst])
        assert got[src, dst] == pytest.approx(want)
    # generation leaves its outputs on both stages, so ref_inf on device 1 already holds them;
    # critic_inf's values sit on its last stage (device 1) and dp rank 0 of actor_train needs half
    assert got["actor_gen", "ref_inf"] == 0.0 and got["critic_inf", "actor_train"] > 0


def test_block_op_counts_follow_an_explicit_head_dim():
    """GEMM FLOPs are 2 per multiply-add of the block's projection weights (from the parameter layout, so the
    128-wide q and o projections of head_dim 32 x 4 heads count), attention FLOPs scale with n_heads * head_dim,
    and the KV cache with n_kv_heads * head_dim."""
    import dataclasses

    from realloc.estimator.hardware import Precision
    from realloc.estimator.opcount import kv_cache_bytes_per_token_layer
    from realloc.models.config import ModelConfig
    from realloc.models.param_layout import param_specs

    base = ModelConfig("std", 64, 64, 176, 2, 4, 2)
    wide = dataclasses.replace(base, name="wide", explicit_head_dim=32)
    prec = Precision.for_dtype("fp32")
    b, s = 2, 16
    for cfg in (base, wide):
        matmul = sum(p.numel for p in param_specs(cfg) if p.layer == 0 and len(p.shape) == 2)
        for tp in (1, 2):
            w = op_work(cfg, Part.BLOCK, Phase.FWD, tp, b, s, prec)
            assert w.gemm_flops == 2 * b * s * matmul / tp
            # QK^T and PV: 2 MACs per (query, key) pair and q feature, causal: (s + 1) / 2 keys per query
            assert w.attn_flops == pytest.approx(4 * b * s * (s + 1) / 2 * cfg.n_heads * cfg.head_dim / tp)
        assert kv_cache_bytes_per_token_layer(cfg, 1, prec) == 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert op_work(wide, Part.BLOCK, Phase.FWD, 1, b, s, prec).attn_flops == 2 * op_work(
        base, Part.BLOCK, Phase.FWD, 1, b, s, prec).attn_flops


def test_generation_beyond_pp_micro_batches_goes_in_waves_of_pp(big):
    """At most pp micro-batches hold a KV cache (models/generation.py): 5 micro-batches at pp 2 cost two full
    waves of 2 and one of 1, each of the same micro-batch size."""
    call = "actor_gen"
    s = S(1, 4, 2)
    timer = big._timer(big.graph.model_config(call))
    links = big.links(big.cluster.whole, s)
    w = big.workload(call)
    b = w.micro_batch(s.dp, 5)

    def gen(n):
        return timer.generate(s, links, b, w.prompt_len, w.gen_len, n).time

    assert gen(5) == pytest.approx(2 * gen(2) + gen(1), rel=1e-12)
    assert gen(4) == pytest.approx(2 * gen(2), rel=1e-12)


def test_bf16_gradient_buffers_halve_the_trained_models_gradient_bytes_and_dp_traffic():
    """grad_dtype="bf16" (the train call's settings): the gradients' static memory is 2 bytes per parameter,
    so a bf16 parameter costs 2 + 2 + 12/2 = 10 bytes at dp 2 (12 with fp32 buffers), and the
    distributed optimizer's reduce-scatter and its packing move 2 bytes per gradient element instead of 4.
    Calls that keep no gradients are priced as before."""
    spec = experiment_spec(GpuPair)
    fp32, bf16 = (CostModel(build_graph(x), discover=False)
                  for x in (spec, apply_overrides(spec, ["ppo.grad_dtype=bf16"])))
    hw, cl = bf16.hw, bf16.cluster
    assert hw.dtype == "bf16" and bf16.call_precision("train").grad == 2 and fp32.call_precision("train").grad == 4
    mesh, s = cl.whole, S(2, 1, 1)
    n = TINY_PARAMS
    chunks = local_optimizer_elems(get_model_config("tiny"), 1, 1, 0, 2)  # ceil(numel / 2) per tensor
    for model, grad in ((fp32, 4), (bf16, 2)):
        m = model.call_memory("train", mesh, s, 1)
        assert (m.params, m.grads, m.optimizer) == (2 * n, grad * n, 12 * chunks)
        assert (m.params + m.grads + m.optimizer) / n == pytest.approx(2 + grad + 12 / 2, abs=1e-3)
        assert model.call_memory("ref", mesh, s, 1) == fp32.call_memory("ref", mesh, s, 1)
        assert model.call_cost("gen", mesh, s, 1) == fp32.call_cost("gen", mesh, s, 1)
    # per optimizer step (2 mini-batches): the reduce-scatter's ring moves (dp - 1) chunks of n / dp elements
    # 2 bytes fewer each, and packing the gradients into the flat buffer and back moves 2 x n x 2 bytes fewer
    bw = cl.intra_node_bandwidth * hw.comm_efficiency
    saved = (2 - 1) * n / 2 * 2 / bw + 2 * n * 2 / (hw.memory_bandwidth * hw.memory_efficiency)
    a, b = fp32.call_cost("train", mesh, s, 1), bf16.call_cost("train", mesh, s, 1)
    assert a.dp_allreduce - b.dp_allreduce == pytest.approx(2 * saved)


@pytest.mark.parametrize("call, mesh, strategy, n_mbs, match", [
    # 512 prompts / 8 mini-batches = 64 sequences per optimizer step: dp 4 x 3 micro-batches does not split them
    ("actor_train", "trainer[01-02]", S(4, 4, 1), 3, "64 sequences per step cannot be split over dp=4 into n_mbs=3"),
    ("actor_gen", "trainer[01-02]", S(1, 16, 1), 1, "tp=16 must divide the 8 devices the mesh uses per node"),
    ("ref_inf", "trainer[01-02]", S(16, 1, 1), 64, "512 sequences per step cannot be split over dp=16 into n_mbs=64"),
    ("actor_train", "trainer[01-02]", S(1, 1, 16), 4, "pp=16 exceeds the"),  # fine: 32 layers; see below
    ("actor_gen", "trainer01", S(8, 1, 1), 1, "recompute applies to TRAIN_STEP calls only"),
    ("actor_train", "trainer01", S(8, 1, 1), 0, "n_mbs must be at least 1"),
])
def test_the_estimator_api_refuses_placements_the_planner_rejects(big, call, mesh, strategy, n_mbs, match):
    """Issue 22 item 23: call_cost and call_memory raise the planner's own error for a placement that no plan could
    use, instead of pricing it; the same placement in a plan fails validate_plan with the same words."""
    m = big.cluster.mesh(mesh)
    recompute = "recompute" in match
    if strategy.pp == 16:  # llama3-8b has 32 layers, so pp=16 is valid: priced, and the plan validates
        assert big.call_cost(call, m, strategy, n_mbs).time > 0
        assert big.call_memory(call, m, strategy, n_mbs).total > 0
        return
    for fn in (big.call_cost, big.call_memory):
        with pytest.raises(ValueError, match=re.escape(match)):
            fn(call, m, strategy, n_mbs, recompute=recompute)
    if n_mbs >= 1:  # ExecutionPlan itself refuses n_mbs < 1
        plan = big_plan(big, call, mesh, strategy, n_mbs, recompute)
        with pytest.raises(ValueError, match=re.escape(match)):
            validate_plan(plan, big.graph)


def big_plan(model: CostModel, call: str, mesh: str, strategy: S, n_mbs: int, recompute: bool) -> ExecutionPlan:
    """A plan of ``model``'s experiment with every call on the whole cluster at dp 16, except ``call``."""
    whole = model.cluster.whole.name
    places = {c: (whole, 16, 1, 1, 1) for c in model.graph.spec.call_names}
    places[call] = (mesh, strategy.dp, strategy.tp, strategy.pp, n_mbs)
    return ExecutionPlan.by_hand(model.graph, places, recompute=[call] if recompute else [])
