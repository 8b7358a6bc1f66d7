"""A user's own algorithm and reward, end to end on the local 2-device CPU cluster (real workers, gloo, ZMQ).

- The docs' example (``docs/algorithms.md``, ``experiments/custom_algorithm``: REINFORCE++ on the train-step API) learns the tiny
  token-set task, and its first iterations give the same numbers with dp=2 training as with a pp=2 pipeline.
- The learning-rate schedule applies to every train step: to a ``TrainStep`` and to a train step written
  against the engine directly; both are checked against the warmup + cosine formula computed here by hand.
- A remote reward service (a local http.server) and a batched reward function reading the records score in a
  real run, and a weighted mix of the two.
- Evaluation with a user's reward function, which reports no stats itself, works and reports ``reward``: the
  mean of the eval samples' scores, recomputed here from their response tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from reward_service import Service

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "experiments/custom_algorithm/my_reinforce_tiny.py")
TARGET = set(range(16, 32))


def _run(experiment: str, plan: dict, iterations: int, run_dir: Path, *extra: str) -> list[dict]:
    spec = load_experiment(experiment)
    path = run_dir.parent / f"{run_dir.name}.plan.json"
    ExecutionPlan.by_hand(build_graph(spec), {c: plan.get(c, plan.get("*")) for c in spec.call_names},
                          source="hand").save(path)
    cmd = [sys.executable, "-m", "realloc.cli", "run", experiment, "--plan", str(path), "--iterations",
           str(iterations), "--run-dir", str(run_dir), "--quiet", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(run_dir.parent), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"{experiment}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


ONE_DEVICE = {"*": ("localhost:0", 1, 1, 1, 1)}
# Generation on device 0, the reference on device 1, the rule and the train step data-parallel over both.
SPREAD = {"*": ("localhost", 2, 1, 1, 1), "actor_gen": ("localhost:0", 1, 1, 1, 1),
          "ref_inf": ("localhost:1", 1, 1, 1, 1)}
# The reference split over tp, the train step over a 2-stage pipeline with 2 micro-batches.
TP_PP = {"*": ("localhost:0", 1, 1, 1, 1), "ref_inf": ("localhost", 1, 2, 1, 1),
         "actor_train": ("localhost", 1, 1, 2, 2)}


def _cosine(base: float, step: int, total: int, warmup_proportion: float, low_ratio: float) -> float:
    """Linear warmup to ``base`` over round(p * total) steps, then cosine to ``low_ratio * base`` at the last step."""
    w = round(warmup_proportion * total)
    if step < w:
        return base * (step + 1) / w
    progress = min(1.0, (step - w) / max(1, total - w - 1))
    low = low_ratio * base
    return low + (base - low) * 0.5 * (1 + math.cos(math.pi * progress))


def test_readme_custom_algorithm_learns_and_does_not_depend_on_the_plan(tmp_path):
    spread = _run(EXAMPLE, SPREAD, 12, tmp_path / "spread")
    reward = [m["reward"] for m in spread]
    assert reward[0] < 0.35 and sum(reward[-3:]) / 3 > reward[0] + 0.2, reward  # chance is 0.25
    assert {"actor_loss", "actor_grad_norm", "actor_lr", "actor_clip_frac"} <= set(spread[0])
    train = [m["calls"]["actor_train"] for m in spread]
    assert abs(train[0]["actor_kl"]) < 1e-4 and train[3]["actor_kl"] > 0.05  # declared stat: KL to the reference
    # dp=2 (batch-wide whitening and normalizers over two ranks) against a pipeline (the loss on its last stage)
    other = _run(EXAMPLE, TP_PP, 3, tmp_path / "tp_pp")
    for a, b in zip(spread[:3], other):
        for k in ("reward", "actor_loss", "actor_grad_norm", "actor_clip_frac"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["iteration"], k)
        assert b["calls"]["actor_train"]["actor_kl"] == pytest.approx(a["calls"]["actor_train"]["actor_kl"],
                                                                       rel=1e-4, abs=1e-6)


def test_cosine_schedule_applies_to_a_train_step_api_train_step(tmp_path):
    # 4 iterations x 2 mini-batches = 8 optimizer steps: 2 of warmup, then cosine down to 0.1 x lr
    metrics = _run(EXAMPLE, ONE_DEVICE, 4, tmp_path / "cos", "--set", "my_reinforce.lr_schedule=cosine",
                   "--set", "my_reinforce.warmup_proportion=0.25", "--set", "my_reinforce.min_lr_ratio=0.1")
    want = [_cosine(2e-3, 2 * i, 8, 0.25, 0.1) for i in range(4)]  # each iteration reports its first step's lr
    assert [m["actor_lr"] for m in metrics] == pytest.approx(want, rel=1e-9)
    assert len(set(want)) == 4  # it changes every iteration


RAW_STEP = '''
import dataclasses

import torch

from realloc.algorithms.common import (actor_generate, actor_logprobs, forward_batch, optimizer_step,
                                       response_columns)
from realloc.algorithms.context import CallResult
from realloc.algorithms.registry import Interface
from realloc.algorithms.train_config import TrainConfig
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto
from realloc.models.batch import split_batch
from realloc.runtime.inputs.evaluation import EvalConfig


@dataclasses.dataclass(frozen=True)
class RawConfig(TrainConfig):
    pass


def raw_train(ctx, inputs):
    """A train step on the engine directly (no TrainStep); it sets no learning rate itself."""
    seq = inputs["seq"]
    seen = []
    for k in range(ctx.call.n_minibatches):
        rows = torch.arange(k, seq["tokens"].shape[0], ctx.call.n_minibatches)
        mb = {**forward_batch({n: t[rows] for n, t in seq.items()}), "prompt_lens": seq["prompt_lens"][rows],
              "mask": seq["gen_mask"][rows]}

        def loss_fn(head, m):
            seen.append(ctx.optimizer.param_groups[0]["lr"])
            lp = response_columns(head.logprobs(), m["prompt_lens"], m["mask"])
            return -lp.sum() / 1000.0, {}

        optimizer_step(ctx, split_batch(mb, ctx.n_mbs), loss_fn)
    return CallResult({}, {}, {f"seen_lr_{k}": v for k, v in enumerate(seen)})


def in_target(ctx, inputs):
    """The share of response tokens in 16..31; it reports no stats: the framework makes them."""
    seq = inputs["seq"]
    rows = seq["prompt_lens"].view(-1, 1) + torch.arange(ctx.gen_len).view(1, -1)
    resp = seq["tokens"].gather(1, rows)
    hit = (resp >= 16) & (resp < 32) & seq["gen_mask"]
    return CallResult({"rewards": {"score": hit.sum(dim=1).float() / seq["gen_mask"].sum(dim=1).clamp(min=1)}},
                      {}, {})


def with_bonus(prompts, responses, records):
    """A batched reward (batch_reward): token id lists here (no tokenizer), and each prompt's record."""
    return [sum(16 <= t < 32 for t in r) / max(len(r), 1) + rec["bonus"] for r, rec in zip(responses, records)]


def _iface(t, fn, **kw):
    return Interface("raw", t, fn, config="raw", config_type=RawConfig, **kw)


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Raw:
    seed: int = 3
    dataset: str = "{PROMPTS}"
    raw: RawConfig = RawConfig(n_minibatches=2, lr=1e-3, lr_schedule="cosine", warmup_proportion=0.2)
    eval: EvalConfig = EvalConfig(dataset="{DATA}/ppo_tiny_eval.jsonl", every=1)

    @property
    def interfaces(self):
        return [_iface(GENERATE, actor_generate, inputs=("prompts",), outputs=("seq", "logp")),
                _iface(TRAIN_STEP, raw_train, inputs=("seq",)),
                Interface("in_target", INFERENCE, in_target, inputs=("seq",), outputs=("rewards",), head="none")]

    @property
    def rpcs(self):
        return [ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type="tiny", interface_type=GENERATE,
                                     interface_impl="raw", input_data=["prompts"], output_data=["seq", "logp"]),
                ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule", interface_type=INFERENCE,
                                     interface_impl="in_target", input_data=["seq"], output_data=["rewards"]),
                ModelFunctionCallDef(name="rew_batch", model_name="reward", interface_type=INFERENCE,
                                     interface_impl="batch_reward", input_data=["seq"], output_data=["batch_r"],
                                     interface_args={"fn": with_bonus}),
                ModelFunctionCallDef(name="rew_remote", model_name="reward", interface_type=INFERENCE,
                                     interface_impl="remote_reward", input_data=["seq"], output_data=["remote"],
                                     interface_args={"url": "{URL}", "batch": 3, "concurrency": 2}),
                ModelFunctionCallDef(name="mix", model_name="reward", interface_type=INFERENCE,
                                     interface_impl="mix_rewards", input_data=["batch_r", "remote"],
                                     output_data=["mixed"], interface_args={"weights": [0.5, 2.0]}),
                ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                     interface_impl="raw", input_data=["seq"])]
'''


def _in_target(response: list[int], record: dict | None = None) -> float:
    return sum(t in TARGET for t in response) / max(len(response), 1)


def test_schedule_eval_and_rewards_with_a_raw_train_step_a_users_reward_function_and_a_service(tmp_path):
    """Also a remote reward service (a local http.server) in a real run: the workers' requests arrive in chunks of
    3, and its scores are the run's ``reward_rew_remote``, the same as the user's function's for the same rule."""
    exp = tmp_path / "raw_step.py"
    # the tiny prompts, each record with one more field, for the batched reward
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({**json.loads(line), "bonus": 0.25}) + "\n" for line in
                               (REPO / "experiments/data/ppo_tiny_prompts.jsonl").read_text().splitlines()))
    with Service(score=_in_target) as svc:
        exp.write_text(RAW_STEP.replace("{DATA}", str(REPO / "experiments/data")).replace("{URL}", svc.url)
                       .replace("{PROMPTS}", str(prompts)))
        metrics = _run(str(exp), ONE_DEVICE, 5, tmp_path / "raw")
    assert svc.requests == 5 * 3 and max(svc.sizes) == 3 and sum(svc.sizes) == 5 * 8
    for m in metrics:
        assert m["reward_rew_remote"] == pytest.approx(m["reward_rew_inf"], rel=1e-6)
        assert m["reward_rew_batch"] == pytest.approx(m["reward_rew_inf"] + 0.25, rel=1e-6)
        assert m["reward_mix"] == pytest.approx(0.5 * m["reward_rew_batch"] + 2.0 * m["reward_rew_remote"], rel=1e-6)
    # 5 iterations x 2 mini-batches = 10 steps: 2 of warmup, then cosine to 0
    for i, m in enumerate(metrics):
        train = m["calls"]["actor_train"]
        assert [train["seen_lr_0"], train["seen_lr_1"]] == pytest.approx(
            [_cosine(1e-3, 2 * i, 10, 0.2, 0.0), _cosine(1e-3, 2 * i + 1, 10, 0.2, 0.0)], rel=1e-9)
        assert m["actor_lr"] == pytest.approx(train["seen_lr_0"], rel=1e-9)  # reported by the framework
    assert metrics[-1]["calls"]["actor_train"]["seen_lr_1"] == pytest.approx(0.0, abs=1e-12)
    # The user's reward function reports nothing; the framework's reward is the mean of its scores (under the
    # call's name: this train step does not read the rewards, so they are not the run's headline) ...
    for m in metrics:
        assert 0 < m["reward_rew_inf"] < 1 and "eval" in m, m
    # ... and evaluation with it works: the eval reward is the mean score of the eval responses, by hand.
    for it, m in enumerate(metrics, start=1):
        lines = [json.loads(x) for p in sorted((tmp_path / "raw" / "eval").glob(f"iter_{it:08d}.rank*.jsonl"))
                 for x in p.read_text().splitlines()]
        assert len(lines) == 8 == m["eval"]["n"]
        by_hand = [_in_target(s["response"]) for s in lines]
        assert [s["score"] for s in lines] == pytest.approx(by_hand)
        assert m["eval"]["reward"] == pytest.approx(sum(by_hand) / len(by_hand))


def test_the_readme_example_is_the_file_the_tests_run():
    readme = (REPO / "docs/algorithms.md").read_text()
    section = readme[readme.index("## Your own train step"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    block = block[:block.index("```")]
    assert "TrainStep(loss" in block and block in (REPO / "experiments/custom_algorithm/my_reinforce.py").read_text()
