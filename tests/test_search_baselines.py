"""Baseline plans follow their published rules."""

from __future__ import annotations

import dataclasses

import pytest

from realloc.algorithms.ppo.ppo_config import ppo_rpcs
from realloc.api import auto, experiment_spec, load_experiment
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement
from realloc.models.config import get_model_config
from realloc.search import baseline
from realloc.search.baselines import split_meshes


def placements(plan):
    return {c: (p.mesh, p.dp, p.tp, p.pp, p.n_mbs) for c, p in plan.placements.items()}


def test_heuristic_reproduces_realhf_appendix_table5():
    spec = load_experiment("experiments/ppo_7b_7b.py")
    plan = baseline(spec, "heuristic")
    # Table 5: every call on trainer[01-02] with TP 8, PP 1, DP 2 and 4 micro-batches.
    assert set(placements(plan).values()) == {("trainer[01-02]", 2, 8, 1, 4)}
    assert plan.source == "baseline:heuristic" and plan.estimated_time > 0
    assert plan.estimated_peak_memory <= spec.cluster.device_memory


def test_heuristic_adds_pipeline_stages_across_nodes_until_it_fits():
    spec = load_experiment("experiments/ppo_70b_7b.py")
    graph = build_graph(spec)
    cost = CostModel(graph)
    plan = baseline(spec, "heuristic", cost)
    got = set(placements(plan).values())
    assert len(got) == 1
    mesh, dp, tp, pp, m = got.pop()
    # 70B actor + ref and 7B critic + reward cannot share 128 GPUs with pp = 1 (each device would hold
    # the 70B model's states in full over tp = 8); stages are whole nodes.
    assert (mesh, tp) == ("trainer[01-16]", 8) and pp > 1 and 16 % pp == 0 and dp * tp * pp == 128
    assert m >= max(4, pp) and plan.estimated_peak_memory <= spec.cluster.device_memory
    # every (pp, n_mbs) the rule tries before it runs out of memory (the estimator's plan_memory)
    mem = spec.cluster.device_memory
    for pp_before in (1, 2, 4, 8):
        for m_before in (4, 8, 16, 32, 64):
            if (pp_before, m_before) >= (pp, m) or m_before < pp_before:
                continue
            trial = plan.model_copy(update={"placements": {
                c: CallPlacement(mesh=mesh, dp=128 // (8 * pp_before), tp=8, pp=pp_before, n_mbs=m_before)
                for c in plan.placements}})
            try:
                peak = max(cost.plan_memory(trial).values())
            except ValueError:  # this micro-batch count does not divide some call's batch
                continue
            assert peak > mem, (pp_before, m_before)


def test_weak_scaling_70b_heuristic_fits_in_two_stages_and_in_the_authors_layout():
    """The 128-GPU point of the appendix's weak scaling (section A): 70B + 7B, batch 4096. The authors ran the
    heuristic at TP 8 / PP 4 / DP 4 with 8 micro-batches on 80 GB A100s. With the distributed optimizer (the
    70B actor's training state at dp 8 is 7.5 B per parameter, not 18) realloc's heuristic already fits with
    two stages; the authors' layout fits with more micro-batches and recomputation (docs/performance.md,
    "Weak scaling at 70B")."""
    spec = load_experiment("experiments/ppo_70b_7b_weak_scaling.py")
    assert (spec.batch_size, spec.cluster.n_devices, spec.prompt_len, spec.gen_len) == (4096, 128, 1024, 1024)
    graph = build_graph(spec)
    assert graph.model_config("actor_train").vocab_size == 128256  # Table 1's LLaMA-3 shapes
    cost = CostModel(graph)
    plan = baseline(spec, "heuristic", cost)
    assert {(p.mesh, p.dp, p.tp, p.pp) for p in plan.placements.values()} == {("trainer[01-16]", 8, 8, 2)}
    assert plan.estimated_peak_memory <= spec.cluster.device_memory
    authors = plan.model_copy(update={"placements": {
        c: CallPlacement(mesh="trainer[01-16]", dp=4, tp=8, pp=4, n_mbs=32, recompute=graph.call(c).is_train)
        for c in plan.placements}})
    assert max(cost.plan_memory(authors).values()) <= spec.cluster.device_memory


def test_colocate_dp_is_data_parallel_with_tp_generation():
    plan = baseline("experiments/ppo_7b_7b.py", "colocate-dp")
    for call, (mesh, dp, tp, pp, _) in placements(plan).items():
        assert mesh == "trainer[01-02]"
        assert (dp, tp, pp) == ((2, 8, 1) if call == "actor_gen" else (16, 1, 1))


def test_split_puts_actor_and_ref_apart_from_critic_and_reward():
    plan = baseline("experiments/ppo_7b_7b.py", "split")
    meshes = {c: p.mesh for c, p in plan.placements.items()}
    assert meshes["actor_gen"] == meshes["actor_train"] == meshes["ref_inf"] == "trainer01"
    assert meshes["critic_inf"] == meshes["critic_train"] == meshes["rew_inf"] == "trainer02"


def test_split_sizes_groups_by_parameter_count():
    graph = build_graph(load_experiment("experiments/ppo_70b_7b.py"))
    a, b = split_meshes(graph)
    big = 2 * get_model_config("llama3-70b").total_params
    small = 2 * get_model_config("llama3-8b-critic").total_params
    assert a.n_nodes == round(16 * big / (big + small)) and b.n_nodes == 16 - a.n_nodes
    assert not a.overlaps(b)


def test_split_on_one_node_takes_halves():
    @auto(nodelist="localhost", n_devices_per_node=4, device="cpu", batch_size=16, prompt_len=8, gen_len=8)
    @dataclasses.dataclass
    class Tiny4:
        @property
        def rpcs(self):
            return ppo_rpcs(actor="tiny", critic="tiny-critic", n_minibatches=2)

    a, b = split_meshes(build_graph(experiment_spec(Tiny4)))
    assert (a.name, b.name) == ("localhost:0-1", "localhost:2-3")


def test_unknown_baseline_names_the_choices():
    with pytest.raises(ValueError, match="heuristic, colocate-dp, split"):
        baseline("experiments/ppo_tiny.py", "megatron")
