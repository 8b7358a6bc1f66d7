"""Fused train pairs in the plan simulators and the MCMC (csrc/fused_node.h): the C++ engine against the Python
reference on random problems with random fused pairs, a hand-computed fused node, and the search choosing
fusion where it pays."""

from __future__ import annotations

import dataclasses

import numpy as np
import networkx as nx
import pytest

from realloc import _C
from realloc.search import reference
from realloc.search.problem import CandidateArrays, FusedPairArrays, PairCosts, SearchProblem
from tests.test_simulator import GiB, assert_agrees, random_plan, random_problem


def _independent(p: SearchProblem, a: int, b: int) -> bool:
    # data and order edges, and each model's chain of calls (a reallocation waits for the model's previous call)
    chain = [(u, v) for u in range(p.n_calls) for v in range(u + 1, p.n_calls) if p.call_model[u] == p.call_model[v]]
    g = nx.DiGraph([*p.data_edges, *p.order_edges, *chain])
    g.add_nodes_from(range(p.n_calls))
    return not nx.has_path(g, a, b) and not nx.has_path(g, b, a)


def with_fused_pair(rng: np.random.Generator, p: SearchProblem) -> SearchProblem | None:
    """``p`` with one random fused pair of independent calls of two models (None if it has none): the second
    call's candidates are the first's devices and pp with other times and bytes, so that plans co-place them
    often; about half the pair's savings and extra bytes priced."""
    pairs = [(a, b) for a in range(p.n_calls) for b in range(a + 1, p.n_calls)
             if p.call_model[a] != p.call_model[b] and _independent(p, a, b)]
    if not pairs:
        return None
    a, b = pairs[int(rng.integers(len(pairs)))]
    ka = p.candidates[a]
    n_layouts_b = p.realloc_costs[p.call_model[b]].n_src
    kb = dataclasses.replace(ka, time=rng.permutation(ka.time) + rng.choice([0.0, 0.5], size=len(ka)),
                             layout=ka.layout % n_layouts_b, mem_dynamic=rng.permutation(ka.mem_dynamic))
    cands = list(p.candidates)
    cands[b] = kb
    saving, extra = PairCosts(len(ka), len(kb)), PairCosts(len(ka), len(kb))
    for i in range(len(ka)):
        for j in range(len(kb)):
            if rng.random() < 0.5:
                saving.known[i, j] = float(rng.choice([0.0, 0.25, 0.5, 1.0]))
            if rng.random() < 0.5:
                extra.known[i, j] = float(rng.integers(0, 3) * GiB // 2)
    pair = FusedPairArrays(a=a, b=b, bound_a=rng.choice([0.0, 0.25, 0.5], size=len(ka)),
                           bound_b=rng.choice([0.0, 0.25, 0.5], size=len(kb)), saving=saving, extra=extra)
    # data tables into and out of b keep their shape: b's layouts are still b's model's
    return dataclasses.replace(p, candidates=tuple(cands), fused=(pair,), cores_per_node=0.0)


def fused_plan(rng: np.random.Generator, p: SearchProblem) -> np.ndarray:
    plan = random_plan(rng, p)
    f = p.fused[0]
    if rng.random() < 0.7:
        plan[f.b] = plan[f.a]  # co-placed
    return np.r_[plan, int(rng.random() < 0.8)].astype(np.int32)


def test_cpp_matches_python_reference_on_random_problems_with_fused_pairs():
    rng = np.random.default_rng(33)
    n_on = n_ends_together = n_inexact = n_fused_peak = n_oom = 0
    trials = 0
    while trials < 400:
        p = with_fused_pair(rng, random_problem(rng))
        if p is None:
            continue
        trials += 1
        cpp = p.to_cpp()
        for _ in range(3):
            plan = fused_plan(rng, p)
            want, sched = assert_agrees(cpp, p, plan, trials)
            mem = cpp.memory(plan)
            static, peak, _ = reference.device_memory(p, plan)
            assert mem["device_static"] == static and mem["device_peak"] == peak, trials
            assert {tuple(r) for r in cpp.missing(plan).tolist()} == reference.missing_pairs(p, plan), trials
            f = p.fused[0]
            if f.on(p, plan):
                n_on += 1
                calls = {(r[1], r[3]): (r[4], r[5]) for r in sched if r[0] == _C.NODE_CALL}
                n_ends_together += all(calls[f.a, t] == calls[f.b, t] for t in range(p.n_iterations))
                n_inexact += not want["exact"]
                n_fused_peak += want["peak_call"] == f.a
            n_oom += not want["feasible"]
    # fused nodes happen often, end both calls together, and sometimes make the memory peak or are unpriced
    assert n_on > 400 and n_ends_together == n_on and n_inexact > 50 and n_fused_peak > 20 and n_oom > 50


def _two_calls(times_a: list[float], times_b: list[float], saving: float, extra: int = 0) -> SearchProblem:
    """Two independent calls of two models on 2 devices; candidate 0 on devices 0-1 (pp 2), 1 on device 0, 2 on
    device 1."""
    def cands(times: list[float]) -> CandidateArrays:
        return CandidateArrays(dev_lo=[0, 0, 1], dev_hi=[2, 1, 2], stage_width=[1, 1, 1], layout=[0, 1, 2],
                               mesh_id=[0, 1, 2], shape_class=[0, 1, 1], time=times, mem_offset=[0, 2, 3, 4],
                               mem_static=[GiB] * 4, mem_dynamic=[GiB] * 4, mem_param=[0] * 4)
    pair = FusedPairArrays(a=0, b=1, bound_a=np.zeros(3), bound_b=np.zeros(3),
                           saving=PairCosts(3, 3, {(0, 0): saving}), extra=PairCosts(3, 3, {(0, 0): float(extra)}))
    return SearchProblem(n_devices=2, device_memory=8 * GiB, call_names=("a", "b"), call_model=(0, 1),
                         model_names=("A", "B"), model_home=(0, 1), candidates=(cands(times_a), cands(times_b)),
                         order_edges=(), carry_edges=((0, 0), (1, 1)), data_edges=(), data_costs=(),
                         realloc_costs=(PairCosts(3, 3), PairCosts(3, 3)), fused=(pair,))


def test_fused_node_hand_computed():
    p = _two_calls([2.0, 5.0, 5.0], [3.0, 5.0, 5.0], saving=1.0, extra=GiB // 2)
    cpp = p.to_cpp()
    serial = cpp.evaluate(np.array([0, 0, 0], np.int32))
    fused = cpp.evaluate(np.array([0, 0, 1], np.int32))
    assert serial["time"] == 5.0 and fused["time"] == 4.0  # 2 + 3 one after the other; 2 + 3 - 1 fused
    # memory: static of both models (2 GiB) + the larger dynamic (1 GiB) + what fusion adds (0.5 GiB)
    assert serial["peak_memory"] == 3 * GiB and fused["peak_memory"] == 3 * GiB + GiB // 2
    assert fused["peak_call"] == 0 and fused == reference.evaluate(p, [0, 0, 1])
    # an entry of 1 on calls placed apart fuses nothing
    apart = cpp.evaluate(np.array([1, 2, 1], np.int32))
    assert apart == cpp.evaluate(np.array([1, 2, 0], np.int32)) and apart["time"] == 5.0


def test_a_fused_pair_of_dependent_calls_is_refused():
    p = _two_calls([2.0, 5.0, 5.0], [3.0, 5.0, 5.0], saving=1.0)
    bad = dataclasses.replace(p, data_edges=((0, 1),), data_costs=(PairCosts(3, 3),))
    with pytest.raises(ValueError, match="fused pair 0: call 1 depends on call 0"):
        bad.to_cpp().evaluate(np.array([0, 0, 1], np.int32))


def _search(p: SearchProblem, start: list[int], **opts) -> list[int]:
    o = _C.SearchOptions()
    o.n_chains, o.n_threads, o.seed = 1, 1, 3
    for k, v in opts.items():
        setattr(o, k, v)
    s = _C.Search(p.to_cpp(), o, np.array([start], np.int32))
    s.run(2000)
    return list(s.best_plan)


def test_mcmc_fuses_where_it_pays_and_not_where_it_does_not():
    # apart: each call alone on one device takes 5 s; together on both devices 2 + 3 s, fused 2.5 s
    pays = _two_calls([2.0, 5.0, 5.0], [3.0, 5.0, 5.0], saving=2.5)
    assert _search(pays, [1, 2, 0]) == [0, 0, 1]
    # co-placed on both devices 3 + 3 s, fused 5.5 s: apart on one device each (5 s) wins
    loses = _two_calls([3.0, 5.0, 5.0], [3.0, 5.0, 5.0], saving=0.5)
    best = _search(loses, [0, 0, 1])
    assert best[:2] in ([1, 2], [2, 1])


# -- the plan space of an experiment ---------------------------------------------------------------------------
def _ppo(nodelist: str, device: str, n_devices: int, actor: str, critic: str, **batch):
    from realloc.algorithms.ppo.ppo_config import ppo_rpcs
    from realloc.api import auto, experiment_spec
    from realloc.graph.dataflow import build_graph

    @auto(nodelist=nodelist, n_devices_per_node=n_devices, device=device, **batch)
    @dataclasses.dataclass
    class PPO:
        @property
        def rpcs(self):
            return ppo_rpcs(actor=actor, critic=critic, n_minibatches=2)

    return build_graph(experiment_spec(PPO))


def _by_hand(graph):
    from realloc.graph.plan import ExecutionPlan

    place = {n: ("trainer01", 4, 1, 2, 4) for n in graph.spec.call_names}
    return ExecutionPlan.by_hand(graph, place, fused=[("actor_train", "critic_train")])


def _gpu_space():
    """PPO with 7B models on one node of 8 A100s (pipelines pay there), every call's placement of ``_by_hand``
    kept."""
    from realloc.search.build import PlanSpace

    graph = _ppo("trainer01", "a100-80g", 8, "llama2-7b", "llama2-7b-critic", batch_size=64, prompt_len=256,
                 gen_len=256)
    return PlanSpace.build(graph, max_n_mbs=4, keep=[_by_hand(graph)])


@pytest.fixture(scope="module")
def gpu_space():
    return _gpu_space()


def test_spaces_without_eligible_pairs_have_none():
    from realloc.search.build import PlanSpace

    # (devices sharing CPU cores get pairs too: tests/test_fused_shared_cores.py)
    # GRPO trains one model: nothing to fuse
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph

    grpo = build_graph(load_experiment("experiments/grpo_7b_7b.py"))
    assert PlanSpace.build(grpo, max_n_mbs=2).problem.fused == ()


def test_search_without_fuse_moves_is_the_search_without_pairs(gpu_space):
    """A space with fused pairs searched with no fuse moves takes the same steps as the space without them:
    plans of experiments with nothing to fuse are those of before."""
    from realloc.search.engine import run_mcmc

    assert len(gpu_space.problem.fused) == 1
    other = _gpu_space()  # tables of its own: pairs priced by one search change the other's provisional costs
    bare = dataclasses.replace(other, problem=dataclasses.replace(other.problem, fused=()))
    a = run_mcmc(gpu_space, time_limit=None, max_evals=6000, seed=5, n_threads=1, n_chains=1, p_fuse=0.0)
    b = run_mcmc(bare, time_limit=None, max_evals=6000, seed=5, n_threads=1, n_chains=1)
    n = gpu_space.problem.n_calls
    assert list(a.indices[:n]) == list(b.indices) and list(a.indices[n:]) == [0]
    assert a.evaluation["time"] == b.evaluation["time"]


def test_a_fused_plan_round_trips_through_the_space_and_prices_as_the_estimator(gpu_space):
    from realloc.estimator.fused_cost import price_fused_pair
    from realloc.search.fused_space import SEARCH_ITERATIONS

    plan = _by_hand(gpu_space.graph)
    idx = gpu_space.indices_of(plan)
    n = gpu_space.problem.n_calls
    assert list(idx[n:]) == [1]
    fused, serial = gpu_space.evaluate(idx), gpu_space.evaluate(np.r_[idx[:n], 0].astype(np.int32))
    out = gpu_space.to_plan(idx, "test")
    assert out.fused == (("actor_train", "critic_train"),) and gpu_space.to_plan(idx[:n].tolist() + [0], "t").fused == ()
    # both train calls sit on the same devices one after the other unfused, so fusing saves exactly the pair's
    # saving, the estimator's (serial - fused) for these placements
    r = price_fused_pair(gpu_space.cost, plan, "actor_train", "critic_train", iterations=SEARCH_ITERATIONS,
                         memory_iterations=SEARCH_ITERATIONS // 2)
    assert r.time < r.serial_time
    assert serial["time"] - fused["time"] == pytest.approx(r.serial_time - r.time, rel=1e-9)


def test_the_estimated_timeline_draws_a_fused_pair_as_one_bar_per_device(gpu_space):
    """realloc show / search --timeline: the fused node is one bar over the mesh per iteration, named after both
    calls and as long as the simulator's fused node; unfused, the two calls are two bars one after the other."""
    from realloc.search.timeline import estimated_panel, legend_entries, timeline_html

    plan = _by_hand(gpu_space.graph)
    idx = gpu_space.indices_of(plan)
    panel = estimated_panel(gpu_space, idx, plan, iterations=2)
    bars = [b for b in panel.boxes if b.kind == "call" and b.iteration in (1, 2) and "train" in b.label]
    assert [b.label for b in bars] == ["actor_train + critic_train"] * 2
    assert all((b.lo, b.hi) == (0, 8) for b in bars)
    f = gpu_space.problem.fused[0]
    ta, tb = (float(gpu_space.problem.candidates[c].time[idx[c]]) for c in (f.a, f.b))
    saving = f.saving.known[int(idx[f.a]), int(idx[f.b])]
    assert all(b.end - b.start == pytest.approx(ta + tb - saving) for b in bars) and saving > 0
    assert "fused with critic_train" in bars[0].detail and "stages in reverse order" in bars[0].detail
    assert "actor_train + critic_train" in [name for name, _, _ in legend_entries([panel])]
    assert "actor_train + critic_train" in timeline_html([panel])
    n = gpu_space.problem.n_calls
    apart = estimated_panel(gpu_space, np.r_[idx[:n], 0].astype(np.int32), plan.model_copy(update={"fused": ()}),
                            iterations=2)
    labels = [b.label for b in apart.boxes if b.kind == "call" and b.iteration == 1 and "train" in b.label]
    assert sorted(labels) == ["actor_train", "critic_train"]


def test_search_report_shows_the_plan_without_fusion_beside_a_fused_one():
    from realloc.search.planner import plan_search
    from realloc.search.report import comparison_table

    graph = _ppo("trainer01", "a100-80g", 8, "llama2-7b", "llama2-7b-critic", batch_size=64, prompt_len=256,
                 gen_len=256)
    report = plan_search(graph.spec, None, max_evals=20000, n_threads=1, seed=1)
    # 7B models on 8 A100s: the search trains both on all 8 at pp > 1, fused (5.03 s against 5.20 s unfused)
    assert report.plan.fused == (("actor_train", "critic_train"),) and report.fused is None
    a, b = (report.plan.placements[c] for c in ("actor_train", "critic_train"))
    assert (a.mesh, a.pp) == (b.mesh, b.pp) and a.pp > 1
    unfused = report.unfused
    assert unfused is not None and unfused.fused == () and unfused.estimated_time > report.plan.estimated_time
    rows = comparison_table(report).splitlines()
    assert rows[2].startswith("searched ") and rows[3].startswith("no fusion ")
    assert f"{unfused.estimated_time:.3f}" in rows[3]
