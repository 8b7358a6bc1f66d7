"""Tool contention priced (issue 34; estimator/multiturn_cost.py ``tool_slowdown``): a tool step takes
step_s / max(1, c0 / cores) x max(1, c / cores), c the tool processes at once on the host under the plan (replicas
on the host x min(env_workers, rollouts per replica)), c0 those when step_s was measured, against hand
computations; a profile measured from a run takes c0 from the run's plan, so that plan is priced at its measured
step and the others scaled."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from realloc.estimator.cost import CostModel
from realloc.estimator.multiturn_cost import tool_slowdown
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.strategy import ParallelStrategy
from test_turn_profile import _env, _fake_run, _spec

ONE, DP2 = ParallelStrategy(1, 1, 1), ParallelStrategy(2, 1, 1)


def test_the_slowdown_by_hand():
    assert tool_slowdown(8, 0, 2) == 4.0  # 8 processes on 2 cores, against a lone call
    assert tool_slowdown(8, 4, 2) == 2.0  # against a step measured with 4 at once
    assert tool_slowdown(4, 8, 2) == 0.5  # fewer at once than when measured: faster
    assert tool_slowdown(2, 0, 4) == 1.0 and tool_slowdown(16, 8, 32) == 1.0  # cores enough: none
    assert tool_slowdown(8, None, 2) == 1.0  # measured at an unknown concurrency: none priced


def _meshes(spec):
    ms = spec.cluster.device_meshes()
    return next(m for m in ms if m.size == 1), next(m for m in ms if m.size == 2)


def test_the_estimator_prices_a_turns_tool_steps_by_the_processes_at_once():
    """32 rollouts, 4 environment threads, every first-turn step a tool call of 0.1 s alone, on the 2-core host:
    dp 1 runs 4 at once (2x), dp 2 runs 2 replicas x 4 = 8 (4x); with 64 cores neither contends."""
    profile = {"policy_tokens": [12, 6], "observation_tokens": [9], "reach": [1.0, 1.0], "step_s": 0.1}
    spec = _spec(_env(turn_profile=profile, env_workers=4))
    cost = CostModel(build_graph(spec))
    one, two = _meshes(spec)
    dp1 = cost.turns("actor_gen", one, ONE, 1)[0].env_s
    dp2 = cost.turns("actor_gen", two, DP2, 1)[0].env_s
    assert dp1 == pytest.approx(math.ceil(32 / 4) * 0.1 * max(1, 4 / 2))
    assert dp2 == pytest.approx(math.ceil(16 / 4) * 0.1 * max(1, 8 / 2))
    # the call's time carries the environment's seconds
    base = cost.call_cost("actor_gen", one, ONE, 1).time
    many = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, cores_per_device=32.0))
    roomy = CostModel(build_graph(many))
    assert roomy.turns("actor_gen", one, ONE, 1)[0].env_s == pytest.approx(8 * 0.1)
    assert roomy.turns("actor_gen", two, DP2, 1)[0].env_s == pytest.approx(4 * 0.1)
    assert base - roomy.call_cost("actor_gen", one, ONE, 1).time == pytest.approx(8 * 0.1 * (2 - 1), rel=1e-6)


def test_a_measured_profile_is_scaled_from_the_runs_plan(tmp_path):
    """The fake run's tool steps took 0.2 s (turns_from_run) under a dp 2 plan over both devices: 8 processes at
    once. Priced under that plan a step stays 0.2 s; under dp 1 (4 at once) it is 0.2 x 2 / 4 = 0.1 s."""
    from realloc.search.turns_report import turns_from

    run = _fake_run(tmp_path / "run")
    spec = _spec(_env(env_workers=4))
    graph = build_graph(spec)
    one, two = _meshes(spec)
    dp2_plan = {c: ("localhost", 2, 1, 1, 1) for c in graph.topo_order}
    ExecutionPlan.by_hand(graph, dp2_plan).save(run / "plan.json")
    measured = turns_from(spec, run)
    cost = CostModel(build_graph(measured))
    prof = cost.rollout_shape("actor_gen").profile
    assert prof.tool_processes == 8 and prof.step_s == pytest.approx(0.2)
    on = prof.goes_on(0)  # 0.75 of the first turn's steps call the tool, the rest end (0.005 s)
    dp2 = cost.turns("actor_gen", two, DP2, 1)[0]
    dp1 = cost.turns("actor_gen", one, ONE, 1)[0]
    assert dp2.env_s == pytest.approx(math.ceil(16 / 4) * (on * 0.2 + (1 - on) * 0.005))
    assert dp1.env_s == pytest.approx(math.ceil(32 / 4) * (on * 0.1 + (1 - on) * 0.005))
    (run / "plan.json").write_text(json.dumps({"not": "a plan"}))  # no plan of the run: nothing scaled
    unknown = CostModel(build_graph(turns_from(spec, run)))
    assert unknown.rollout_shape("actor_gen").profile.tool_processes is None
    assert unknown.turns("actor_gen", one, ONE, 1)[0].env_s == pytest.approx(
        math.ceil(32 / 4) * (on * 0.2 + (1 - on) * 0.005))
