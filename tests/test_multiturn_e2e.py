"""A multi-turn GRPO run end to end on the local 2-device CPU cluster (real workers, gloo, ZMQ, the sandbox): the
tiny model from random weights, the calc demo's prompts and tokenizer, and the tests' LengthEnv (its rewards vary
with what a random policy says, so the policy learns; its observations come from the calculator in the sandbox),
on three plans. The same seed gives the same rollouts (token by token, samples.jsonl), rewards and losses under
all three, and the GENERATE call reports its turns and tool calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides
from test_algorithms_e2e import HEADLINE, _plans

REPO = Path(__file__).resolve().parents[1]
STATS = ("turns", "policy_tokens", "env_tokens", "gen_tokens", "score_sum")
EXPERIMENT = f'''
import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto

ENV = {{"env": "multiturn_cases:make_env", "env_args": {{"turns": 2, "tool": True}}, "max_turns": 2,
       "turn_tokens": 8}}


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class MultiTurnTiny:
    seed: int = 1
    dataset: str = "{REPO}/experiments/data/calc_train.jsonl"
    tokenizer: str = "{REPO}/experiments/data/calc_tokenizer"
    iterations: int = 2
    sample_every: int = 1
    log_samples: int = 16  # every rollout
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=1e-2, kl_coef=0.01)

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=4)
'''


def _run(experiment: str, plan_name: str, iterations: int, base: Path) -> tuple[list[dict], list[dict]]:
    spec = load_with_overrides(experiment, [])
    run_dir = base / plan_name
    plan = ExecutionPlan.by_hand(build_graph(spec), _plans(spec.call_names)[plan_name], source=plan_name)
    plan.save(base / f"{plan_name}.json")
    cmd = [sys.executable, "-m", "realloc.cli", "run", experiment, "--plan", str(base / f"{plan_name}.json"),
           "--iterations", str(iterations), "--run-dir", str(run_dir), "--quiet"]
    path = f"{REPO}{os.pathsep}{REPO / 'tests'}"  # the workers import the environment from tests/multiturn_cases.py
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(base), "PYTHONPATH": path})
    assert r.returncode == 0, f"{plan_name}:\n{r.stdout}\n{r.stderr}"
    def lines(name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]

    return lines("metrics.jsonl"), lines("samples.jsonl")


def test_multiturn_grpo_runs_and_does_not_depend_on_the_plan(tmp_path):
    experiment = tmp_path / "multiturn_tiny.py"
    experiment.write_text(EXPERIMENT)
    experiment = str(experiment)
    # three plans: generation on one device beside the reference on the other; everything on one device; every
    # call data-parallel over both devices (each replica runs the environments of its half of the rollouts)
    spread, spread_samples = _run(experiment, "spread", 2, tmp_path)
    for plan in ("one_device", "dp2"):
        one, samples = _run(experiment, plan, 2, tmp_path)
        _same_rollouts(spread_samples, samples, plan)
        _same_run(spread, one)
    gen = spread[0]["calls"]["actor_gen"]
    assert gen["n_seqs"] == 16 and gen["turns"] == 32  # two turns each
    assert gen["policy_tokens"] > 0 and gen["env_tokens"] > 0 and gen["tool_ok"] == 16  # one tool call each
    assert spread[-1]["kl"] > 1e-3  # the policy moved: not a degenerate comparison


def _same_rollouts(a: list[dict], b: list[dict], plan: str) -> None:
    """Every rollout of both iterations: the same prompt and conversation token by token, the same turns (where the
    policy's tokens are) and the same reward."""
    assert len(a) == len(b) == 2 * 16, plan
    key = lambda r: (r["iteration"], r["seq"])  # noqa: E731
    for x, y in zip(sorted(a, key=key), sorted(b, key=key)):
        for field in ("iteration", "seq", "prompt_ids", "response_ids", "turn_segments", "reward"):
            assert x[field] == y[field], (plan, x["iteration"], x["seq"], field)
        assert len(x["turn_segments"]) == 4  # first observation, turn, observation, turn
    assert len({r["reward"] for r in a}) > 1  # rewards that differ: a comparison that can fail


def _same_run(spread: list[dict], one: list[dict]) -> None:
    for a, b in zip(spread, one):
        assert b["reward"] == pytest.approx(a["reward"], rel=1e-6) and b["response_len"] == a["response_len"]
        # KL and losses of a barely trained random model are differences at rounding level: an absolute tolerance
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-4), (a["iteration"], k)
        for k in STATS:
            assert b["calls"]["actor_gen"][k] == pytest.approx(a["calls"]["actor_gen"][k]), k
