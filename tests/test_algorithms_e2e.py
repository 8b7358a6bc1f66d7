"""GRPO, RLOO and ReMax end to end on the local 2-device CPU cluster (real workers, gloo, ZMQ), and an
interface that an experiment file declares itself, run by the workers.

Each shipped tiny experiment (the token-set task of ppo_tiny, no critic) runs on two hand-written plans:
- "spread": generation on device 0, the reference on device 1, the rule reward and the train step
  data-parallel over both (groups of responses stay whole on each dp rank); it trains long enough to
  learn: the mean reward must rise clearly from chance (~0.25);
- "one device": everything on device 0; its first iterations must give the same metrics as the spread
  plan's (plan invariance: the same seed gives the same numbers under every plan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan

REPO = Path(__file__).resolve().parents[1]
N_COMPARE = 3
# One response per prompt (ReMax) is a noisier signal than a group of four: it gets more iterations.
N_LEARN = {"grpo": 12, "rloo": 12, "remax": 20}
HEADLINE = ("reward", "kl", "actor_loss", "approx_kl", "actor_grad_norm", "adv_abs_mean", "response_len")


def _plans(calls: tuple[str, ...]) -> dict[str, dict]:
    spread = {c: ("localhost", 2, 1, 1, 1) for c in calls}
    spread.update({c: ("localhost:0", 1, 1, 1, 1) for c in calls if c.startswith("actor_g")})
    if "ref_inf" in calls:
        spread["ref_inf"] = ("localhost:1", 1, 1, 1, 1)
    one = {c: ("localhost:0", 1, 1, 1, 1) for c in calls}
    # Tensor and pipeline parallelism: the reference split over tp, the train step over pp.
    tp_pp = {**one, "ref_inf": ("localhost", 1, 2, 1, 1), "actor_train": ("localhost", 1, 1, 2, 2)}
    # Every call data-parallel over both devices, generation included: each rank samples the groups of its prompts.
    dp2 = {c: ("localhost", 2, 1, 1, 1) for c in calls}
    return {"spread": spread, "one_device": one, "tp_pp": {c: tp_pp[c] for c in calls}, "dp2": dp2}


def _run(experiment: str, plan_name: str, iterations: int, base: Path, *extra: str) -> list[dict]:
    spec = load_experiment(experiment)
    graph = build_graph(spec)
    run_dir = base / f"{Path(experiment).stem}-{plan_name}"
    plan = ExecutionPlan.by_hand(graph, _plans(spec.call_names)[plan_name], source=plan_name)
    plan.save(base / f"{run_dir.name}.json")
    cmd = [sys.executable, "-m", "realloc.cli", "run", experiment, "--plan", str(base / f"{run_dir.name}.json"),
           "--iterations", str(iterations), "--run-dir", str(run_dir), "--quiet", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(base), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"{experiment} {plan_name}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("algo", ["grpo", "rloo", "remax"])
def test_critic_free_algorithm_learns_and_does_not_depend_on_the_plan(algo, tmp_path):
    experiment = str(REPO / f"experiments/{algo}_tiny.py")
    spread = _run(experiment, "spread", N_LEARN[algo], tmp_path)
    first = sum(m["reward"] for m in spread[:2]) / 2
    last = sum(m["reward"] for m in spread[-3:]) / 3
    assert first < 0.35 and last > first + 0.12, (algo, [round(m["reward"], 3) for m in spread])
    one = _run(experiment, "one_device", N_COMPARE, tmp_path)
    for a, b in zip(spread[:N_COMPARE], one):
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (algo, a["iteration"], k)
    assert spread[N_COMPARE - 1]["kl"] > 0.01  # the policy moved: not a degenerate comparison
    if algo == "remax":  # the greedy response's reward is reported beside the policy's
        assert "reward_rew_greedy" in spread[0] and spread[0]["reward"] != spread[0]["reward_rew_greedy"]


def _same(a: list[dict], b: list[dict], keys: tuple[str, ...], what: str) -> None:
    for x, y in zip(a, b):
        for k in keys:
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-5), (what, x["iteration"], k)


def test_sft_lowers_its_loss_and_does_not_depend_on_the_plan(tmp_path):
    experiment = str(REPO / "experiments/sft_tiny.py")
    spread = _run(experiment, "spread", 12, tmp_path)
    loss = [m["sft_loss"] for m in spread]
    # From about log(64) (a uniform guess over the tiny model's vocabulary) to under 70% of it (measured 51-55%
    # over three CPU instruction sets and three seeds: docs/machine-variance.md).
    assert loss[0] > 3.5 and max(loss[-3:]) < 0.7 * loss[0], loss
    for plan in ("one_device", "tp_pp"):
        _same(spread[:N_COMPARE], _run(experiment, plan, N_COMPARE, tmp_path), ("sft_loss", "actor_grad_norm"), plan)


DPO_HEADLINE = ("dpo_loss", "dpo_accuracy", "dpo_margin", "chosen_reward", "rejected_reward", "actor_grad_norm")


def test_dpo_raises_preference_accuracy_and_margin_and_does_not_depend_on_the_plan(tmp_path):
    experiment = str(REPO / "experiments/dpo_tiny.py")  # as shipped: 64 pairs, so a short run sees each several times
    spread = _run(experiment, "spread", 12, tmp_path)
    acc, margin = [m["dpo_accuracy"] for m in spread], [m["dpo_margin"] for m in spread]
    assert abs(spread[0]["dpo_loss"] - 0.6931) < 0.02  # the actor starts as its reference: margins near 0
    # From chance (accuracy ~0.5, margin ~0) to clearly above it. Measured over three CPU instruction sets and
    # three seeds: accuracy 0.885-0.938, margin 1.00-1.64 (docs/machine-variance.md): the bars sit well below.
    assert sum(acc[-3:]) / 3 > 0.75 and sum(margin[-3:]) / 3 > 0.5 and abs(margin[0]) < 0.1, (acc, margin)
    # Iteration 1's first mini-batch scores pairs while actor == reference: its margins are rounding noise around
    # 0, whose sign (the accuracy) may differ between layouts. Every other number must agree.
    for plan in ("one_device", "tp_pp"):
        other = _run(experiment, plan, N_COMPARE, tmp_path)
        _same(spread[:1], other[:1], tuple(k for k in DPO_HEADLINE if k != "dpo_accuracy"), plan)
        _same(spread[1:N_COMPARE], other[1:], DPO_HEADLINE, plan)


OWN_INTERFACE = '''
import dataclasses

import torch

from realloc.algorithms.context import CallResult
from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.algorithms.registry import Interface
from realloc.api import INFERENCE, auto


def even_token_share(ctx, inputs):
    """The share of even token ids in each response: a reward only this file knows."""
    seq = inputs["seq"]
    rows = seq["prompt_lens"].view(-1, 1) + torch.arange(ctx.gen_len).view(1, -1)
    resp = seq["tokens"].gather(1, rows)
    mask = seq["gen_mask"]
    score = ((resp % 2 == 0) & mask).sum(dim=1).float() / mask.sum(dim=1).clamp(min=1).float()
    return CallResult({{"rewards": {{"score": score}}}}, {{"score_sum": float(score.sum()),
                                                       "n_seqs_scored": float(score.numel())}}, {{}})


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class OwnReward:
    seed: int = 2
    dataset: str = "{DATASET}"
    sample_every: int = 1
    log_samples: int = 16
    grpo: GRPOConfig = GRPOConfig(lr=1e-3)

    @property
    def interfaces(self):
        return [Interface("even_share", INFERENCE, even_token_share, inputs=("seq",), outputs=("rewards",),
                          head="none")]

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=4, reward_impl="even_share")
'''


def test_an_interface_declared_in_the_experiment_file_runs_in_the_workers(tmp_path):
    """Also group sampling with the generation split over dp=2: each rank generates the 4 responses to each of its
    prompts, and the groups stay whole through the transfers to the reward and the dp=2 train step, whose
    group-normalized advantages must be those computed by hand from the logged rewards."""
    exp = tmp_path / "own_reward.py"
    exp.write_text(OWN_INTERFACE.format(DATASET=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    metrics = _run(str(exp), "dp2", 2, tmp_path)
    samples = [json.loads(line) for line in (tmp_path / "own_reward-dp2" / "samples.jsonl").read_text().splitlines()]
    assert {s["iteration"] for s in samples} == {1, 2} and len(samples) == 32  # every sequence of both batches
    for s in samples:  # the worker ran this file's function: each reward is the share of even response tokens
        resp = s["response_ids"]
        assert s["reward"] == pytest.approx(sum(t % 2 == 0 for t in resp) / len(resp))
    for it, m in zip((1, 2), metrics):
        batch = sorted((s for s in samples if s["iteration"] == it), key=lambda s: s["seq"])
        assert [s["seq"] for s in batch] == list(range(16))
        scores = [s["reward"] for s in batch]
        assert m["reward"] == pytest.approx(sum(scores) / len(scores))
        # Sequences 4g .. 4g+3 answer prompt g: the same prompt within a group, four prompts in all.
        groups = [batch[4 * g:4 * g + 4] for g in range(4)]
        assert all(len({tuple(s["prompt_ids"]) for s in grp}) == 1 for grp in groups)
        assert len({tuple(grp[0]["prompt_ids"]) for grp in groups}) == 4
        # GRPO's advantage by hand: (r - group mean) / (group's Bessel std + 1e-6); the train step reports the mean
        # |advantage| over the batch.
        adv = []
        for grp in groups:
            r = [s["reward"] for s in grp]
            mean = sum(r) / 4
            std = (sum((x - mean) ** 2 for x in r) / 3) ** 0.5
            adv += [abs(x - mean) / (std + 1e-6) for x in r]
        assert m["adv_abs_mean"] == pytest.approx(sum(adv) / 16, rel=1e-4, abs=1e-6), it
        assert m["adv_abs_mean"] > 0.1  # the groups' rewards differ: not a vacuous comparison
    assert 0 < metrics[0]["reward"] < 1


def _failing_run(tmp_path: Path, rank1_does: str, *extra: str) -> tuple[list[str], float]:
    """Run OWN_INTERFACE on the dp=2 plan with ``rank1_does`` (a line of code) at the start of the reward
    function's return on dp rank 1; the run must fail: its stderr lines and how long it took."""
    import time

    source = OWN_INTERFACE.format(DATASET=REPO / "experiments/data/ppo_tiny_prompts.jsonl").replace(
        "    return CallResult({", f"    if ctx.ids.start > 0:  # dp rank 1 only\n        {rank1_does}\n"
        "    return CallResult({", 1)
    assert rank1_does in source
    exp = tmp_path / "own_reward.py"
    exp.write_text(source)
    spec = load_experiment(str(exp))
    plan = ExecutionPlan.by_hand(build_graph(spec), _plans(spec.call_names)["dp2"], source="dp2")
    plan.save(tmp_path / "plan.json")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", str(exp), "--plan", str(tmp_path / "plan.json"),
                        "--iterations", "2", "--run-dir", str(tmp_path / "run"), "--quiet", *extra],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, (r.stdout, r.stderr)
    return err, time.monotonic() - t0


def test_an_interface_that_returns_nothing_on_one_rank_stops_the_run_naming_it(tmp_path):
    """The per-rank output check in real workers: the reward call, data-parallel over both devices, returns no
    outputs on dp rank 1 (device 1). The run stops in its first iteration with one error naming the call, the
    interface and the rank, rather than a store error in the train step that reads the rewards."""
    err, _ = _failing_run(tmp_path, "return CallResult({}, {}, {})")
    assert err[0].startswith("realloc run: error: worker 1 failed in call rew_inf (iteration 1): ValueError: call "
                             "'rew_inf': interface 'even_share' returned no outputs on rank 1, so key 'rewards'"), err
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text()


def test_a_worker_stuck_in_a_collective_is_caught_by_the_call_timeout(tmp_path):
    """On dp rank 1 the reward function enters a barrier of the whole world that rank 0 never enters. Its
    heartbeat thread goes on, so only the call timeout can tell: the run stops about --call-timeout seconds
    later, naming the worker and its call, and leaves no worker behind (torch would wait 30 minutes)."""
    err, elapsed = _failing_run(tmp_path, "torch.distributed.barrier()", "--call-timeout", "4")
    assert err[0].startswith("realloc run: error: worker 1 has run one request for "), err
    assert "longer than the call timeout of 4 s (--call-timeout;" in err[0], err
    assert "while running call 'rew_inf' of iteration 1" in err[0], err
    assert elapsed < 120, elapsed  # start-up, 4 s and the stop; not torch's 30 minutes
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout.split()
    assert left == [], left  # every worker (their command lines name the run directory) is gone
