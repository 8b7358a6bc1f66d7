"""Long-tail migration and streaming with generation running ahead of training (staleness 1, asynchronous RL;
issue 31, docs/tail-semantics.md): a run with the tail entry equals the same staleness-1 run without it (samples
with their parameter versions, metrics, the whole checkpoint with optimizer state and RNG), PPO migrating its tail
to replica 0 and GRPO streaming from device 0 to device 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_stream_run import DEVICE_0
import test_streaming
from test_streaming import R_T, _experiment, assert_inference_in_two_parts, assert_same_runs

STALE = 1
N_ITER = 3  # the third iteration samples with version 1 (one step behind): a version counted twice shows
CASES = {"ppo": ((R_T, 1), ("localhost", 2, 1, 1, 1)), "grpo": ((R_T, 0), DEVICE_0)}


def run_with(tmp_path, exp, name: str, tail: dict, gen_mesh: tuple, sets: list[str], staleness: int = 0):
    """test_streaming._run with experiment overrides ``sets`` (``--set``) and the plan's ``staleness``."""
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from realloc.overrides import load_with_overrides
    from test_runtime_e2e import env

    graph = build_graph(load_with_overrides(str(exp), sets))
    places = {c: (("localhost", 2, 1, 1, 1) if graph.call(c).is_train else gen_mesh if c == "actor_gen" else
                  ("localhost:1", 1, 1, 1, 1)) for c in graph.spec.call_names}
    plan = tmp_path / f"{name}.json"
    ExecutionPlan.by_hand(graph, places, source="hand", staleness=staleness, tail=tail).save(plan)
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet", "--plan",
           str(plan), "--iterations", str(test_streaming.N_ITER), *[a for x in sets for a in ("--set", x)]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_tail_at_staleness_1_matches_the_same_run_without_it(tmp_path, monkeypatch, algo):
    monkeypatch.setattr(test_streaming, "N_ITER", N_ITER)  # its checks read the run's length from there
    tail, mesh = CASES[algo]
    exp = _experiment(tmp_path, algo)
    ahead = [f"max_staleness={STALE}"]
    tailed = run_with(tmp_path, exp, "tailed", {"actor_gen": tail}, mesh, ahead, STALE)
    plain = run_with(tmp_path, exp, "plain", {}, mesh, ahead, STALE)
    assert_inference_in_two_parts(tailed)
    assert_same_runs(tailed, plain, iterations=N_ITER)
    # generation ran one step ahead (iteration t sampled with version max(0, t - 1)), the same with the tail entry
    for run in (tailed, plain):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["staleness"]["versions"]["actor_gen"] for m in rows] == [0, 0, 1]
        assert [m["staleness"]["max"] for m in rows] == [0, 1, 1]


@pytest.mark.parametrize("tail", [(6, 1), (6, 0)])
def test_both_simulators_order_the_next_generation_after_the_tail_at_staleness_1(tail):
    """What the runtime does at staleness 1, simulated (C++ and the Python reference agree): the generation of
    iteration t + 1 starts only after iteration t's tail (TAIL node) ends, as the runtime's schedule orders it, and
    the split consumers run their part 1 (PART nodes) every iteration."""
    import dataclasses

    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from realloc.lengths import ResponseLengths
    from realloc.search.build import PlanSpace
    from realloc.search.tail_reference import PART, TAIL
    from test_simulator import assert_agrees

    base = load_experiment("experiments/ppo_tiny.py")
    spec = dataclasses.replace(base, gen_len=128, response_lengths=ResponseLengths.lognormal(8, 102.4), max_staleness=1)
    graph = build_graph(spec)
    gen_mesh = ("localhost", 2, 1, 1, 1) if tail[1] else ("localhost:0", 1, 1, 1, 1)
    places = {c: (("localhost", 2, 1, 1, 1) if graph.call(c).is_train else gen_mesh if c == "actor_gen" else
                  ("localhost:1", 1, 1, 1, 1)) for c in spec.call_names}
    space = PlanSpace.build(graph, CostModel(graph)).with_staleness(1)
    p = space.problem
    plan = space.indices_of(ExecutionPlan.by_hand(graph, places, tail={"actor_gen": tail}, staleness=1))
    _, sched = assert_agrees(p.to_cpp(), p, plan, tail)
    g = p.call_names.index("actor_gen")
    rows = [dict(zip(("kind", "call", "other", "iteration", "start", "end"), r[:6])) for r in sched]
    gen = {r["iteration"]: r for r in rows if r["kind"] == 0 and r["call"] == g}
    tails = {r["iteration"]: r for r in rows if r["kind"] == TAIL and r["call"] == g}
    parts = [r for r in rows if r["kind"] == PART and r["end"] > r["start"]]
    assert {r["iteration"] for r in parts} == set(gen)  # the inference calls on device 1 ran their part 1
    for t in range(len(gen) - 1):
        assert tails[t]["end"] > tails[t]["start"] and gen[t + 1]["start"] >= tails[t]["end"]
