"""The search's arrays and simulator agree with the estimator's own API on real experiments."""

from __future__ import annotations

import numpy as np
import pytest

from realloc import _C
from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.search.build import PlanSpace, canonical_layouts


@pytest.fixture(scope="module")
def space() -> PlanSpace:
    return PlanSpace.build(build_graph(load_experiment("experiments/ppo_7b_7b.py")))


def random_plans(space: PlanSpace, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.array([rng.integers(0, k) for k in space.n_candidates], np.int32) for _ in range(n)]


def test_device_memory_equals_estimator_plan_memory(space):
    n_oom = 0
    for idx in random_plans(space, 25, seed=3):
        plan = space.to_plan(idx, "random")
        want = space.cost.plan_memory(plan)
        got = space.cpp.memory(idx)["device_peak"]
        assert got == [want[d] for d in range(len(got))]
        assert plan.estimated_peak_memory == max(want.values())
        n_oom += max(want.values()) > space.graph.spec.cluster.device_memory
    assert 0 < n_oom < 25  # both outcomes are exercised


def test_node_durations_come_from_the_estimator(space):
    p, cost, graph = space.problem, space.cost, space.graph
    # parameters move along each model's chain of calls: from the previous call's layout
    prev = {}
    for model in graph.model_types:
        chain = [c for c in p.call_names if graph.call(c).model_name == model]
        prev.update(zip(chain, [chain[-1], *chain[:-1]]))
    n_realloc = n_data = n_offloaded = n_recompute = 0
    for idx in random_plans(space, 10, seed=4):
        space.evaluate(idx)  # prices what the plan needs
        layout = {name: space.options[c][int(idx[c])] for c, name in enumerate(p.call_names)}
        for kind, call, other, it, start, end, *_ in space.cpp.schedule(idx):
            name = p.call_names[call]
            mesh, s, m, rc, offloaded = layout[name]
            if kind == _C.NODE_CALL:
                # an offloaded model is loaded from host memory before its call
                load = cost.offload_cost(graph.call(name).model_name, (mesh, s)) if offloaded else 0.0
                want = cost.call_cost(name, mesh, s, m, rc).time + load
                assert end - start == pytest.approx(want, rel=1e-9, abs=1e-9)
                n_recompute += rc
                n_offloaded += offloaded
            elif kind == _C.NODE_REALLOC:
                model = graph.call(name).model_name
                assert p.call_names[other] == prev[name]
                pm, ps, *_ = layout[prev[name]]
                want = cost.realloc_cost(model, (pm, ps), (mesh, s))
                assert end - start == pytest.approx(want, rel=1e-9, abs=1e-9) or (want == 0 and end == start)
                n_realloc += end > start
            else:
                src = p.call_names[other]
                sm, ss, *_ = layout[src]
                want = cost.data_transfer_cost(src, name, (sm, ss), (mesh, s))
                # a free transfer takes no time and occupies no device
                assert end - start == pytest.approx(want, rel=1e-9, abs=1e-9) or (want == 0 and end == start)
                n_data += 1
    assert n_realloc > 0 and n_data > 0 and n_offloaded > 0 and n_recompute > 0


def test_canonical_relabelling_keeps_transfer_costs():
    # Pairs are priced with the nodes they use relabelled 0, 1, ...; on a homogeneous cluster the
    # estimator must give the same cost as for the original placement.
    graph = build_graph(load_experiment("experiments/ppo_7b_34b.py"))  # 4 nodes
    space = PlanSpace.build(graph)
    p, cost = space.problem, space.cost
    rng = np.random.default_rng(5)
    actor = p.model_names.index("actor")
    lays = space.layouts[actor]
    moved = 0
    for _ in range(24):
        a, b = (lays[int(i)] for i in rng.integers(0, len(lays), 2))
        ca, cb = canonical_layouts(graph, a, b)
        moved += (ca[0], cb[0]) != (a[0], b[0])
        assert cost.realloc_cost("actor", ca, cb) == pytest.approx(cost.realloc_cost("actor", a, b), rel=1e-12)
        assert cost.data_transfer_cost("actor_gen", "ref_inf", ca, cb) == pytest.approx(
            cost.data_transfer_cost("actor_gen", "ref_inf", a, b), rel=1e-12)
    assert moved >= 8
