"""Smoke test of the shipped "your own model and data" experiment, experiments/ppo_hf_tiny.py, as its
docstring runs it: `realloc search --dry-run` plans it from the CLI, `realloc run` trains on that plan
and exports, and the export loads in transformers.

The experiment file and its prompts are copied to a temporary directory, so the demo checkpoints it
builds beside itself on first load land there, not in the repository.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from realloc.api import load_experiment
from realloc.cli import main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan

REPO = Path(__file__).resolve().parents[1]


def test_ppo_hf_tiny_plans_runs_and_exports(tmp_path, capsys):
    exp = tmp_path / "exp" / "ppo_hf_tiny.py"
    (exp.parent / "data").mkdir(parents=True)
    shutil.copy(REPO / "experiments/ppo_hf_tiny.py", exp)
    shutil.copy(REPO / "experiments/data/text_prompts.jsonl", exp.parent / "data")

    plan_file = tmp_path / "plan.json"
    assert main(["search", str(exp), "--dry-run", "--evals", "2000", "--threads", "1", "--out", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "searched plan" in out and "estimated time per iteration" in out
    plan = ExecutionPlan.load(plan_file)
    validate_plan(plan, build_graph(load_experiment(str(exp))))
    assert not (tmp_path / "run").exists()  # a dry run launches nothing

    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", str(exp), "--plan", str(plan_file),
                        "--iterations", "1", "--export-every", "1", "--run-dir", str(run), "--quiet"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    [m] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m["iteration"] == 1 and math.isfinite(m["reward"]) and 0 < m["response_len"] <= 16
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["prompt"] and len(s["logp"]) == len(s["response_ids"]) for s in samples)

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    exported = run / "exports" / "iter_00000001"
    assert AutoModelForCausalLM.from_pretrained(exported / "actor").config.vocab_size > 0
    assert AutoModelForSequenceClassification.from_pretrained(exported / "critic").config.num_labels == 1
