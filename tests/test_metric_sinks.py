"""Metric sinks besides metrics.jsonl (issue 14, item 1): what a metrics line becomes, and Weights & Biases in
offline mode (TensorBoard is read back in tests/test_run_operations.py)."""

from __future__ import annotations

import json

import pytest

from realloc.runtime.records.metric_sinks import MetricSinks, scalars_of

LINES = [{"iteration": i, "reward": 0.25 + 0.125 * i, "kl": 0.01 * i, "iteration_time": 1.5,
          "time": {"actor_gen": 0.5 + i, "realloc": 0.03}, "calls": {"actor_gen": {"n_seqs": 32.0}},
          "eval": {"reward": 0.5 * i, "n": 64}} for i in (1, 2, 3)]


def test_scalars_are_named_by_group():
    s = scalars_of({**LINES[0], "tokens": 4096})  # tokens: the same every iteration, not a curve
    assert s == {"train/reward": 0.375, "train/kl": 0.01, "train/iteration_time": 1.5, "time/actor_gen": 1.5,
                 "time/realloc": 0.03, "eval/reward": 0.5, "eval/n": 64.0}


def test_wandb_logs_offline_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # an optional extra for installs; the test environment has it
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sinks = MetricSinks.open(tmp_path, tensorboard=False, wandb_project="realloc-test", run_name="t",
                             config={"experiment": "x"})
    # The run header says which mode was chosen.
    assert sinks.describe() == "metrics also to: wandb offline project realloc-test (`wandb sync` uploads it)"
    for m in LINES:
        sinks.write(m)
    sinks.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # offline: kept on disk for `wandb sync`
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"train/reward", b"time/actor_gen", b"eval/reward"):
        assert key in data
    for m in LINES:  # every iteration's value, as wandb's JSON encoding of it
        assert json.dumps(m["reward"]).encode() in data


def test_a_missing_wandb_package_is_one_error_before_any_worker(tmp_path, monkeypatch, capsys):
    import sys

    from realloc.cli import main
    from run_helpers import TINY, disjoint_plan

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    disjoint_plan().save(tmp_path / "plan.json")
    run = tmp_path / "run"
    code = main(["run", TINY, "--plan", str(tmp_path / "plan.json"), "--iterations", "1", "--run-dir", str(run),
                 "--wandb", "proj"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["realloc run: error: --wandb needs the wandb package: pip install 'realloc[wandb]'"]
    assert not (run / "logs").exists() and not (run / "secret").exists()  # no worker was started
