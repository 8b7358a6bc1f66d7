"""The search's arrays and simulator agree with the estimator's own API on real experiments."""

from __future__ import annotations

import numpy as np
import pytest

from realloc import _C
from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.search.build import PlanSpace, home_calls


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
    homes = home_calls(graph)
    n_realloc = n_data = 0
    for idx in random_plans(space, 10, seed=4):
        space.evaluate(idx)  # prices what the plan needs
        layout = {name: space.options[c][int(idx[c])] for c, name in enumerate(p.call_names)}
        for kind, call, other, it, start, end, *_ in space.cpp.schedule(idx):
            name = p.call_names[call]
            mesh, s, m = layout[name]
            if kind == _C.NODE_CALL:
                assert end - start == pytest.approx(cost.call_cost(name, mesh, s, m).time, rel=1e-9, abs=1e-9)
            elif kind == _C.NODE_REALLOC:
                model = graph.call(name).model_name
                assert p.call_names[other] == homes[model]
                hm, hs, _ = layout[homes[model]]
                assert end - start == pytest.approx(cost.realloc_cost(model, (hm, hs), (mesh, s)), rel=1e-9, abs=1e-9)
                n_realloc += 1
            else:
                src = p.call_names[other]
                sm, ss, _ = layout[src]
                want = cost.data_transfer_cost(src, name, (sm, ss), (mesh, s))
                # a free transfer takes no time and occupies no device
                assert end - start == pytest.approx(want, rel=1e-9, abs=1e-9) or (want == 0 and end == start)
                n_data += 1
    assert n_realloc > 0 and n_data > 0
