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
    assert_same_runs(tailed, plain)
    # generation ran one step ahead (iteration t sampled with version max(0, t - 1)), the same with the tail entry
    for run in (tailed, plain):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["staleness"]["versions"]["actor_gen"] for m in rows] == [0, 0, 1]
        assert [m["staleness"]["max"] for m in rows] == [0, 1, 1]
