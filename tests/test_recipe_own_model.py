"""docs/recipe-own-model-grpo.md runs as written: every ```bash block of the page, in order, in one shell, on a
copy of experiments/own_model/ (so the tiny checkpoint it builds on first use lands in a temporary folder), with
2 iterations instead of 20, 1 s of plan search instead of 5 and a free port instead of 8123.

Checked against the reward function itself: every logged sample's reward in the runs with the function in the
workers and with the same function behind the URL is ``my_reward.score`` of that sample's texts and record, and
the GRPO run after SFT records the SFT export as its actor."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs/recipe-own-model-grpo.md"


def doc_commands() -> list[str]:
    return [line for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
            for line in block.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records() -> list[dict]:
    return [json.loads(x) for x in (REPO / "experiments/data/text_prompts.jsonl").read_text().splitlines()]


def _check_rewards(run: Path, score, tokenizer) -> None:
    """Each logged sample's reward is the reward function's score of its prompt and response, decoded from their
    ids as a reward call decodes them, and its record (a left-truncated prompt is the end of its record's)."""
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        prompt = tokenizer.decode(s["prompt_ids"], skip_special_tokens=True)
        response = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
        [rec] = [r for r in _records() if r["prompt"].strip().endswith(prompt.strip())][:1]
        record = {k: v for k, v in rec.items() if k != "prompt"}
        assert s["reward"] == pytest.approx(score([prompt], [response], [record])[0], abs=1e-6), s


def test_every_command_of_the_recipe_runs(tmp_path):
    commands = doc_commands()
    assert sum(c.startswith("realloc run") for c in commands) == 3 and any("&" in c for c in commands)
    root = tmp_path / "repo"
    shutil.copytree(REPO / "experiments/own_model", root / "experiments/own_model",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "experiments/data").mkdir()
    shutil.copy(REPO / "experiments/data/text_prompts.jsonl", root / "experiments/data")
    port = str(_free_port())
    script = [f'realloc() {{ "{sys.executable}" -m realloc.cli "$@" --quiet 2>&1 | tail -n 3; '
              f'return "${{PIPESTATUS[0]}}"; }}',
              "set -e", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]  # the service, should a command fail
    for c in commands:
        c = c.replace("--iterations 20", "--iterations 2").replace("--search-time 5", "--search-time 1")
        c = c.replace("8123", port)
        if c.startswith("realloc") and not c.startswith("realloc run"):
            c = c.replace("realloc ", f'"{sys.executable}" -m realloc.cli ', 1)  # no --quiet for show/export
        if c.startswith("python "):  # the interpreter itself (not a shell function): `kill %1` then stops it
            c = c.replace("python ", f'"{sys.executable}" ', 1)
        script.append(c)
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=root, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "reward rew_inf: score(first record, empty response) = 0" in r.stdout
    runs = root / "runs"
    for name in ("own-grpo", "own-sft", "own-sft-grpo"):
        metrics = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
        assert [m["iteration"] for m in metrics] == [1, 2], name
    spec = importlib.util.spec_from_file_location("my_reward", root / "experiments/own_model/my_reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from realloc.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(root / "experiments/data/hf_tiny/sft")
    _check_rewards(runs / "own-grpo", mod.score, tokenizer)
    _check_rewards(runs / "own-sft-grpo", mod.score, tokenizer)  # scored by the service
    run_json = json.loads((runs / "own-sft-grpo" / "run.json").read_text())
    assert str(runs / "own-sft-actor") in json.dumps(run_json)
