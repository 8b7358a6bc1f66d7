"""Audit, round 13: a new user's audit of the seventh round's features (the KV-cache move at a tail migration,
streaming at pp > 1, parallel tool calls, Phi-3 / Gemma / per-layer windows, prepare undo, export sweeping, the
collective busy-wait). Each test of a defect failed before its fix; its docstring says what the user saw."""

from __future__ import annotations

import pytest
from run_helpers import REPO

PPO = str(REPO / "experiments/ppo_tiny.py")  # gen_len 8, batch 32


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_collective_spin_setting_is_one_line_before_any_worker_runs(tmp_path, monkeypatch, capsys, value):
    """`REALLOC_COLLECTIVE_SPIN_MS=abc realloc run ppo_tiny.py` loaded the models, generated and scored, then
    stopped at iteration 1's critic_train with "worker 0 failed in call critic_train (iteration 1): ValueError:
    ..." and a worker log to read. The setting is read before any worker starts now (preflight), and no run
    directory is left."""
    from realloc.cli import main

    monkeypatch.setenv("REALLOC_COLLECTIVE_SPIN_MS", value)
    run = tmp_path / "run"
    assert main(["run", PPO, "--baseline", "colocate-dp", "--iterations", "1", "--run-dir", str(run)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "REALLOC_COLLECTIVE_SPIN_MS" in err and "worker" not in err, err
    assert not run.exists()
