"""Multi-turn rollouts with the rest of realloc, end to end on the local 2-device CPU cluster (real workers, the
sandboxed calculator): PPO (a critic whose values and GAE cover the policy's tokens), GRPO with a LoRA actor
whose reference is its own base, generating one train step ahead (bounded staleness, decoupled objective), and
RLOO and REINFORCE++ (their advantages recomputed from the logged rewards and turns)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides

REPO = Path(__file__).resolve().parents[1]
HEAD = f'''
import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, RLOOConfig
from realloc.algorithms.critic_free.pg_algorithms import ReinforcePPConfig
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.algorithms.lora_graph import reference_from_base
from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import auto
from realloc.models.lora_config import LoRAConfig

ENV = {{"env": "multiturn_cases:make_env", "env_args": {{"turns": 2, "tool": True}}, "max_turns": 2,
       "turn_tokens": 8}}
DATA = "{REPO}/experiments/data"
'''
# every experiment below: 4 prompts x 4 rollouts of the calc data on the 2-device CPU cluster
AUTO = '''

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=24'''
FIELDS = '''
    seed: int = 1
    dataset: str = DATA + "/calc_train.jsonl"
    tokenizer: str = DATA + "/calc_tokenizer"
'''
PPO = HEAD + AUTO + ''')
@dataclasses.dataclass
class MultiTurnPPO:''' + FIELDS + '''    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=1e-2, critic_lr=1e-2, kl_coef=0.01)

    @property
    def rpcs(self):
        return multiturn_rpcs("ppo", env=ENV, actor="tiny", critic="tiny-critic", n_samples=4)
'''
LORA = HEAD + AUTO + ''',
      max_staleness=1)
@dataclasses.dataclass
class MultiTurnLoRA:''' + FIELDS + '''    sample_every: int = 1
    log_samples: int = 16
    lora: LoRAConfig = LoRAConfig(rank=4, alpha=8)
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=5e-2, kl_coef=0.01, decoupled=True)

    @property
    def rpcs(self):
        return reference_from_base(multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=4))
'''
CRITIC_FREE = HEAD + AUTO + ''')
@dataclasses.dataclass
class MultiTurnCriticFree:''' + FIELDS + '''    sample_every: int = 1
    log_samples: int = 16
    {algorithm}: {settings} = {settings}(n_minibatches=2, lr=1e-2, kl_coef=0.0)

    @property
    def rpcs(self):
        return multiturn_rpcs("{algorithm}", env=ENV, actor="tiny", n_samples=4)
'''


def _run(tmp: Path, name: str, source: str, placements: dict, iterations: int, staleness: int = 0):
    experiment = tmp / f"{name}.py"
    experiment.write_text(source)
    graph = build_graph(load_with_overrides(str(experiment), []))
    plan = ExecutionPlan.by_hand(graph, {c: placements.get(c, placements["*"]) for c in graph.topo_order},
                                 staleness=staleness)
    plan.save(tmp / f"{name}.json")
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(experiment), "--plan", str(tmp / f"{name}.json"),
           "--iterations", str(iterations), "--run-dir", str(tmp / name), "--quiet"]
    path = f"{REPO}{os.pathsep}{REPO / 'tests'}"  # the workers import the environment from tests/multiturn_cases.py
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": path})
    assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_multiturn_ppo_trains_actor_and_critic_on_the_policy_tokens(tmp_path):
    metrics = _run(tmp_path, "ppo", PPO, {"*": ("localhost:0", 1, 1, 1, 1), "critic_inf": ("localhost:1", 1, 1, 1, 1),
                                          "critic_train": ("localhost:1", 1, 1, 1, 1)}, 2)
    for m in metrics:
        gen = m["calls"]["actor_gen"]
        assert gen["turns"] == 32 and gen["tool_ok"] == 16 and gen["env_tokens"] > 0
        critic = m["calls"]["critic_train"]
        for k in ("critic_loss", "value_mean", "return_mean"):
            assert math.isfinite(critic[k]), k
        assert math.isfinite(m["calls"]["actor_train"]["actor_loss"])
    assert metrics[-1]["kl"] > 1e-4  # the actor moved
    assert metrics[0]["calls"]["critic_train"]["critic_loss"] > 0


def test_multiturn_grpo_with_a_lora_actor_one_step_ahead(tmp_path):
    split = {"*": ("localhost:1", 1, 1, 1, 1), "actor_gen": ("localhost:0", 1, 1, 1, 1)}
    metrics = _run(tmp_path, "lora", LORA, split, 3, staleness=1)
    assert [m["staleness"]["max"] for m in metrics] == [0, 1, 1]
    samples = [json.loads(line) for line in (tmp_path / "lora" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 16 and all(s["iteration"] - 1 - s["version"] <= 1 for s in samples)
    assert all(len(s["turn_segments"]) == 4 and "reward" in s for s in samples)
    train = [m["calls"]["actor_train"] for m in metrics]
    assert all(t["behav_weight"] > 0 for t in train)
    assert metrics[-1]["kl"] > 1e-4  # the adapters moved the actor away from its base (the reference)


def _rloo(rewards: list[float], policy_tokens: list[int]) -> float:
    """RLOO's mean |advantage| per rollout: each reward less the mean of its group's other three."""
    groups = [rewards[i:i + 4] for i in range(0, len(rewards), 4)]  # a prompt's 4 rollouts are consecutive
    return sum(abs(r - (sum(g) - r) / 3) for g in groups for r in g) / len(rewards)


def _reinforce_pp(rewards: list[float], policy_tokens: list[int]) -> float:
    """REINFORCE++'s mean |advantage| per policy token (no KL, gamma 1): every policy token's return is its
    rollout's reward, whitened over the batch's policy tokens."""
    n = sum(policy_tokens)
    mean = sum(k * r for k, r in zip(policy_tokens, rewards)) / n
    std = (sum(k * r * r for k, r in zip(policy_tokens, rewards)) / n - mean * mean + 1e-8) ** 0.5
    return sum(k * abs(r - mean) for k, r in zip(policy_tokens, rewards)) / n / std


@pytest.mark.parametrize("algorithm, settings, hand", [("rloo", "RLOOConfig", _rloo),
                                                      ("reinforce_pp", "ReinforcePPConfig", _reinforce_pp)])
def test_multiturn_advantages_are_the_algorithm_s_over_the_environment_s_rewards(tmp_path, algorithm, settings, hand):
    source = CRITIC_FREE.replace("{algorithm}", algorithm).replace("{settings}", settings)
    metrics = _run(tmp_path, algorithm, source, {"*": ("localhost:0", 1, 1, 1, 1)}, 2)
    samples = [json.loads(line) for line in (tmp_path / algorithm / "samples.jsonl").read_text().splitlines()]
    for m in metrics:
        rows = sorted((s for s in samples if s["iteration"] == m["iteration"]), key=lambda s: s["seq"])
        assert len(rows) == 16 and all(len(s["turn_segments"]) == 4 for s in rows)
        rewards = [s["reward"] for s in rows]
        assert len(set(rewards)) > 1  # rewards that differ: the comparison can fail
        policy = [sum(s["turn_segments"][1::2]) for s in rows]  # the runs after each observation are the policy's
        assert m["calls"]["actor_train"]["adv_abs_mean"] == pytest.approx(hand(rewards, policy), rel=1e-4)
        assert m["calls"]["actor_gen"]["tool_ok"] == 16
