"""Heterogeneous clusters (issue 32, docs/heterogeneous.md): pools of device kinds, priced per kind, searched
together; one pool is today's cluster exactly."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import numpy as np
import pytest
from test_simulator import random_plan, random_problem

from realloc import cli
from realloc.api import Pool, load_experiment
from realloc.cluster import ClusterSpec
from realloc.estimator.cost import CostModel
from realloc.estimator.hardware import load_hardware_spec
from realloc.estimator.memory import local_params
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.search.candidates import footprint
from realloc.search.planner import plan_search
from realloc.search.pool_space import on_cluster, pool_alone, strongest_pool
from realloc.strategy import ParallelStrategy

GiB = 2**30
A100, V100 = Pool("a100-01", "a100-80g", 8), Pool("v100-[01-02]", "v100-32g", 4)

EXPERIMENT = """
import dataclasses
from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import Pool, auto

@auto(pools=[Pool("a100-01", "a100-80g", 8), Pool("v100-[01-02]", "v100-32g", 4{dtype})], batch_size=64,
      prompt_len=256, gen_len=256)
@dataclasses.dataclass
class Het:
    ppo: PPOConfig = PPOConfig(n_minibatches=2)

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama2-7b", critic="llama2-7b-critic", n_minibatches=self.ppo.n_minibatches)
"""


@pytest.fixture(scope="module")
def het(tmp_path_factory):
    path = tmp_path_factory.mktemp("het") / "het.py"
    path.write_text(textwrap.dedent(EXPERIMENT.format(dtype="")))
    spec = load_experiment(str(path))
    return path, spec, build_graph(spec)


# -- pools -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,n", [("a100-80g", 8), ("h100-80g", None), ("cpu", None), ("v100-32g", 4)])
def test_one_pool_is_todays_cluster(kind, n):
    assert ClusterSpec.from_pools([Pool("com[01-02]", kind, n)]) == ClusterSpec.from_nodelist("com[01-02]", n, kind)
    mem = ClusterSpec.from_pools([{"nodelist": "com01", "device": kind, "device_memory": 3 * GiB}])
    assert mem == ClusterSpec.from_nodelist("com01", None, kind, device_memory=3 * GiB)


@pytest.mark.parametrize("path", ["experiments/ppo_7b_7b.py", "experiments/grpo_7b_7b.py", "experiments/ppo_tiny.py"])
def test_shipped_experiments_in_pool_form_are_the_same_cluster(path):
    spec = load_experiment(path)
    c = spec.cluster
    one = ClusterSpec.from_pools([Pool(c.nodelist, c.device, c.n_devices_per_node)])
    assert one == c and not one.pools
    assert CostModel(build_graph(dataclasses.replace(spec, cluster=one))).pool_models == ()


def test_pools_number_devices_pool_by_pool():
    c = ClusterSpec.from_pools([A100, V100])
    assert c.n_devices == 16 and c.pool_offsets == (0, 8) and c.device == "a100-80g+v100-32g"
    # every mesh is one pool's own mesh, shifted by the pool's first device id
    want = [(m.name, tuple(d + off for d in m.device_ids))
            for p, off in zip(c.pools, c.pool_offsets) for m in p.device_meshes()]
    assert [(m.name, m.device_ids) for m in c.device_meshes()] == want
    assert sorted({d for m in c.device_meshes() for d in m.device_ids}) == list(range(16))
    assert c.mesh("v100-02:2-3").device_ids == (14, 15) and c.mesh("v100-02:2-3").pool == 1
    assert c.mesh("v100-[01-02]").device_ids == tuple(range(8, 16))
    assert c.mesh("v100-02").in_pool.device_ids == (4, 5, 6, 7)
    assert [c.node_of(d) for d in (0, 7, 8, 11, 12, 15)] == [0, 0, 1, 1, 2, 2]
    assert c.memory_of(c.mesh("v100-01")) == int(32 * GiB * 0.9) and c.memory_of(c.mesh("a100-01")) == int(72 * GiB)
    # the link between pools defaults to the slower pool's inter-node link
    v100 = load_hardware_spec("v100-32g")
    assert (c.pool_link_bandwidth, c.pool_link_latency) == (v100.inter_node_bandwidth, v100.inter_node_latency)
    c2 = ClusterSpec.from_pools([A100, V100], link_bandwidth=5e9, link_latency=1e-4)
    assert (c2.pool_link_bandwidth, c2.pool_link_latency) == (5e9, 1e-4)
    assert "pool 1: v100-[01-02]: 2 node(s) x 4 v100-32g" in c.describe()


def test_a_pool_computes_in_its_dtype():
    assert load_hardware_spec("v100-32g").compute_dtypes == ("fp16",)
    fp16 = Pool("a", "a100-80g", 8, dtype="fp16").cluster()
    assert fp16.hardware.dtype == "fp16" and fp16.hardware.peak_flops == load_hardware_spec("a100-80g").peak_flops
    assert Pool("a", "a100-80g", 8, dtype="bf16").cluster() == ClusterSpec.from_nodelist("a", 8, "a100-80g")


@pytest.mark.parametrize("pools,kw,msg", [
    ([Pool("v1", "v101")], {}, "pool 0: unknown device kind 'v101'"),
    ([A100, Pool("v1", "v100-32g", dtype="bf16")], {}, "pool 1: .*'v100-32g' computes in fp16, not 'bf16'"),
    ([A100, Pool("a100-01", "v100-32g")], {}, "node 'a100-01' is in pool 0 and pool 1"),
    ([A100], {"link_bandwidth": 1e9}, "one pool has no link"),
    ([A100, V100], {"link_bandwidth": 0}, "pool_link_bandwidth must be a positive number"),
    ([A100, {"nodelist": "v1", "kind": "v100-32g"}], {}, "unknown pool field 'kind'"),
])
def test_mistyped_pools_are_one_clear_error(pools, kw, msg):
    with pytest.raises(ValueError, match=msg):
        ClusterSpec.from_pools(pools, **kw)


def test_a_mesh_lies_inside_one_pool():
    c = ClusterSpec.from_pools([A100, V100])
    with pytest.raises(ValueError, match=r"mesh 'a100-01,v100-01' spans pool 0 \(a100-80g\) and pool 1 \(v100-32g\)"):
        c.mesh("a100-01,v100-01")
    with pytest.raises(ValueError, match="names node 'x1', which is not in the cluster"):
        c.mesh("x1")


def test_show_lists_pools_and_refuses_a_plan_across_pools(het, tmp_path, capsys):
    path, spec, graph = het
    assert cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 pools" in out and "pool 0: a100-01" in out and "pool 1: v100-[01-02]" in out
    good = {c: ("v100-[01-02]" if "inf" in c else "a100-01", 8, 1, 1, 1) for c in spec.call_names}
    plan = ExecutionPlan.by_hand(graph, good)
    plan.save(tmp_path / "good.json")
    assert cli.main(["show", str(path), "--plan", str(tmp_path / "good.json")]) == 0
    assert "ref_inf on pool 1" in capsys.readouterr().out
    bad = json.loads(plan.to_json())
    bad["placements"]["actor_train"]["mesh"] = "a100-01,v100-01"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert cli.main(["show", str(path), "--plan", str(tmp_path / "bad.json")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "call 'actor_train': mesh 'a100-01,v100-01' spans pool 0" in err[0]
    wrong = tmp_path / "wrong.py"
    wrong.write_text(textwrap.dedent(EXPERIMENT.format(dtype=", dtype='bf16'")))
    assert cli.main(["show", str(wrong)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "computes in fp16, not 'bf16'" in err[0]


# -- estimator ---------------------------------------------------------------------------------------
def test_each_call_is_priced_on_its_pools_kind(het):
    _, spec, graph = het
    cost = CostModel(graph)
    c = spec.cluster
    for pool in range(2):
        alone = CostModel(build_graph(pool_alone(spec, pool)))  # a cluster of that kind only: the reference
        for mesh in c.device_meshes():
            if mesh.pool != pool or mesh.size not in (2, 4):
                continue
            s = ParallelStrategy(1, mesh.size, 1) if mesh.n_nodes == 1 else ParallelStrategy(mesh.size, 1, 1)
            for call in ("actor_gen", "critic_inf", "actor_train"):
                own = alone.call_cost(call, mesh.in_pool, s, 2)
                assert cost.call_cost(call, mesh, s, 2) == own
                assert cost.call_memory(call, mesh, s, 2) == alone.call_memory(call, mesh.in_pool, s, 2)
    # the same call is slower on a V100 (125 TFLOP/s fp16) than on an A100 (312 TFLOP/s bf16)
    s = ParallelStrategy(1, 4, 1)
    assert (cost.call_cost("actor_train", c.mesh("v100-01"), s, 2).time
            > 2 * cost.call_cost("actor_train", c.mesh("a100-01:0-3"), s, 2).time)


def test_reallocation_between_pools_is_priced_on_the_pool_link(het):
    _, spec, graph = het
    c = ClusterSpec.from_pools([A100, V100], link_bandwidth=5e9, link_latency=0.0)
    cost = CostModel(build_graph(dataclasses.replace(spec, cluster=c)))
    one = ParallelStrategy(1, 1, 1)
    src, dst = (c.mesh("a100-01:0"), one), (c.mesh("v100-01:1"), one)
    cfg = cost.model_config_of("actor")
    # every parameter crosses the link once, in the sender's dtype (bf16: 2 bytes); messages share the devices
    # and serialize, so the hand formula is bytes / bandwidth, plus the receiver's request overhead
    want = local_params(cfg, 1, 1, 0) * 2 / 5e9 + load_hardware_spec("v100-32g").call_overhead
    assert cost.realloc_cost("actor", src, dst) == pytest.approx(want, rel=1e-9)
    # data between pools: what ref_inf reads of actor_gen's outputs (the sequences, 8 bytes per token) crosses once
    seqs = graph.steps_n_seqs("actor_gen") * spec.seq_len * 8
    assert cost.transferred_keys("actor_gen", "ref_inf") == ("seq",)
    want = seqs / 5e9 + load_hardware_spec("v100-32g").call_overhead
    assert cost.data_transfer_cost("actor_gen", "ref_inf", src, dst) == pytest.approx(want, rel=1e-9)
    # inside one pool: exactly what the pool alone prices
    a, b = (c.mesh("v100-01"), ParallelStrategy(1, 4, 1)), (c.mesh("v100-02"), ParallelStrategy(2, 2, 1))
    alone = CostModel(build_graph(pool_alone(dataclasses.replace(spec, cluster=c), 1)))
    assert cost.realloc_cost("actor", a, b) == alone.realloc_cost("actor", (a[0].in_pool, a[1]), (b[0].in_pool, b[1]))


# -- search ------------------------------------------------------------------------------------------
def test_cpp_matches_reference_with_per_pool_memory():
    rng = np.random.default_rng(32)
    n_differs = n_fit = n_oom = 0
    for trial in range(300):
        p = random_problem(rng)
        if p.n_devices < 2:
            continue
        cuts = sorted(set(int(x) for x in rng.integers(1, p.n_devices, size=int(rng.integers(1, 3)))))
        starts = (0, *cuts)
        memory = tuple(int(rng.integers(1, 12)) * GiB // 2 for _ in starts)
        p = dataclasses.replace(p, pool_start=starts, pool_memory=memory, device_memory=max(memory))
        cpp = p.to_cpp()
        for _ in range(2):
            plan = random_plan(rng, p)
            got, want = cpp.evaluate(plan), reference.evaluate(p, plan)
            assert got == want, (trial, plan)
            # brute force: a plan fits when every device's peak fits its own pool's memory
            _, peak, _ = reference.device_memory(p, plan)
            excess = max(b - memory[max(i for i, s in enumerate(starts) if s <= x)] for x, b in enumerate(peak))
            assert want["feasible"] == (excess <= 0) and want["overflow"] == max(0, excess)
            n_differs += want["feasible"] != (max(peak) <= p.device_memory)
            n_fit += want["feasible"]
            n_oom += not want["feasible"]
    assert n_differs > 20 and n_fit > 50 and n_oom > 50


def test_plan_space_prunes_by_each_pools_memory(het):
    _, spec, graph = het
    space = PlanSpace.build(graph)
    assert space.problem.pool_start == (0, 8) and space.problem.pool_memory == (int(72 * GiB), int(32 * GiB * 0.9))
    pools_seen = set()
    for c, k in enumerate(space.problem.candidates):
        for i, cand in enumerate(space.options[c]):
            pools_seen.add(cand.mesh.pool)
            need = footprint(k.stage_memory(i, "static"), k.stage_memory(i, "dynamic"), k.stage_memory(i, "param"))
            assert need <= spec.cluster.memory_of(cand.mesh)
    assert pools_seen == {0, 1}


def test_search_on_pools_is_never_slower_than_the_strongest_pool_alone(het):
    _, spec, graph = het
    report = plan_search(spec, None, max_evals=3000, n_threads=1)
    assert report.alone_pool == strongest_pool(spec.cluster) == 0 and report.alone is not None
    assert report.plan.estimated_time <= report.alone.plan.estimated_time
    # the strongest pool's plan costs the same on the whole cluster (its pool's model prices it as alone), up to a
    # fused train pair's schedule, which each space searches briefly (within 0.1%, search/fused_space.py)
    lifted = on_cluster(report.alone.plan, graph)
    validate_plan(lifted, graph)
    assert report.space.evaluate(report.space.indices_of(lifted))["time"] == pytest.approx(
        report.alone.plan.estimated_time, rel=1e-12 if not report.alone.plan.fused else 1e-3)


# -- runtime -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool,want", [
    (Pool("localhost", "cpu", 2), ("float32", 4)),
    (Pool("localhost", "cpu-bf16", 2), ("bfloat16", 2)),
    (Pool("com01", "a100-80g", 8), ("bfloat16", 2)),
    (Pool("com01", "a100-80g", 8, dtype="fp16"), ("float16", 2)),
    (Pool("com01", "v100-32g", 8), ("float16", 2)),
])
def test_workers_hold_parameters_in_the_pools_dtype(pool, want):
    from realloc.runtime.control.program import RuntimeProgram

    spec = dataclasses.replace(load_experiment("experiments/grpo_tiny.py"), cluster=ClusterSpec.from_pools([pool]))
    graph = build_graph(spec)
    mesh = spec.cluster.device_meshes()[-1].name  # the whole cluster
    n = spec.cluster.n_devices
    plan = ExecutionPlan.by_hand(graph, {c: (mesh, n, 1, 1, 1) for c in spec.call_names})
    program = RuntimeProgram(graph, plan)
    assert (program.param_dtype, program.bytes_per_param) == want


def test_run_of_gpu_pools_without_the_gpus_is_one_line(het, capsys):
    """GPU pools run (tests/test_pool_launch.py); the local launcher says, before searching, what it lacks."""
    import torch

    path, spec, _ = het
    if torch.cuda.device_count() >= spec.cluster.n_devices:
        pytest.skip("this machine has the GPUs")
    assert cli.main(["run", str(path), "--iterations", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 2 pools of" in err[0] and "--launcher slurm" in err[0]


def test_baselines_of_a_cluster_of_pools_run_on_its_strongest_pool(het):
    from realloc.search.planner import baseline

    _, spec, graph = het
    plan = baseline(spec, "heuristic")
    alone = baseline(pool_alone(spec, 0), "heuristic")
    assert {m.pool for m in validate_plan(plan, graph).values()} == {0}
    assert plan.placements == alone.placements and plan.estimated_time == alone.estimated_time
