"""``realloc run`` of a plan that fuses actor_train and critic_train (issue 33 item 4; docs/fused-training.md):
one iteration of experiments/ppo_tiny.py on the 2-device CPU cluster at pp 2, the actor's train step at 2
micro-batches with recomputation, the critic's at 8 without, against the same plan unfused. Both runs'
checkpoints (parameters and optimizer states of both models, every shard) and the train calls' stats agree;
the fused run sent one request for the pair and its workers fused every optimizer step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from run_helpers import REPO, TINY

PAIR = ("actor_train", "critic_train")


def _plan(fused: bool) -> ExecutionPlan:
    g = build_graph(load_experiment(TINY))
    pl = {c: ("localhost", 2, 1, 1, 1) if g.model_config(c) is None else ("localhost", 1, 1, 2, 2) for c in g.topo_order}
    pl["actor_train"], pl["critic_train"] = ("localhost", 1, 1, 2, 2), ("localhost", 1, 1, 2, 8)
    return ExecutionPlan.by_hand(g, pl, recompute=frozenset({"actor_train"}), fused=[PAIR] if fused else [],
                                 source="hand")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fused_run")
    out = {}
    for name in ("serial", "fused"):
        _plan(name == "fused").save(base / f"{name}.json")
        cmd = [sys.executable, "-m", "realloc.cli", "run", TINY, "--plan", str(base / f"{name}.json"), "--iterations",
               "1", "--save-every", "1", "--run-dir", str(base / name), "--quiet"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "TMPDIR": str(base), "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, r.stdout + r.stderr
        out[name] = base / name
    return out


def test_both_models_parameters_and_optimizer_states_equal_the_serial_runs(runs):
    shards = sorted((runs["serial"] / "checkpoints/iter_00000001/models").glob("*/*.safetensors"))
    assert len(shards) == 4  # actor and critic, 2 stages each
    for path in shards:
        rel = path.relative_to(runs["serial"])
        serial, fused = load_file(path), load_file(runs["fused"] / rel)
        assert serial.keys() == fused.keys()
        assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in serial)  # the whole state
        for k in serial:
            assert torch.allclose(serial[k].double(), fused[k].double(), rtol=0, atol=1e-6), (rel, k)


def test_the_train_calls_report_the_same_stats(runs):
    serial, fused = ([json.loads(x) for x in (runs[n] / "metrics.jsonl").read_text().splitlines()][0]["calls"]
                     for n in ("serial", "fused"))
    for c in PAIR:
        assert serial[c].keys() == fused[c].keys() and f"{c.split('_')[0]}_loss" in fused[c]
        for k in serial[c]:
            assert fused[c][k] == pytest.approx(serial[c][k], rel=1e-6, abs=1e-9), (c, k)


def test_one_request_runs_the_pair_and_every_step_is_fused(runs):
    calls = [json.loads(x) for x in (runs["fused"] / "requests.jsonl").read_text().splitlines()]
    labels = [r["label"] for r in calls if r["kind"] == "call"]
    assert labels.count("actor_train+critic_train") == 1 and not set(PAIR) & set(labels)
    for rank in (0, 1):
        log = (runs["fused"] / f"logs/worker{rank}.log").read_text()
        assert "actor_train + critic_train: 2 optimizer steps of each fused" in log  # ppo_tiny's 2 mini-batches
        assert "critic layout localhost~reversed2 dp1·tp1·pp2" in log


def test_the_timeline_draws_both_calls_passes_inside_the_request(runs, tmp_path):
    """Each device recorded every pass of both calls (2 optimizer steps x (2 + 8 micro-batches) x forward and
    backward), inside the pair's request on that device; ``realloc trace`` draws them."""
    from realloc.cli import main as cli
    from realloc.runtime.records.fused_passes import with_passes

    requests = [json.loads(x) for x in (runs["fused"] / "requests.jsonl").read_text().splitlines()]
    rows = with_passes(requests, runs["fused"])
    fused = next(r for r in requests if r["label"] == "+".join(PAIR))
    for rank in ("0", "1"):
        passes = [r for r in rows if "pass" in r and rank in r["spans"]]
        assert len(passes) == 2 * (2 + 8) * 2
        assert {r["label"] for r in passes} == set(PAIR)
        lo, hi = fused["spans"][rank]
        assert all(lo <= r["spans"][rank][0] <= r["spans"][rank][1] <= hi for r in passes)
    out = tmp_path / "timeline.html"
    assert cli(["trace", str(runs["fused"]), "--timeline", str(out), "--no-estimate"]) == 0
    assert "critic_train" in out.read_text() and "actor_train+critic_train" in out.read_text()
