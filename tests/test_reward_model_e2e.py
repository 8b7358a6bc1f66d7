"""Reward-model training end to end (real workers, gloo, ZMQ), then its use as the reward model of a PPO run.

- ``experiments/arith_rm.py`` as shipped (the demo's SFT checkpoint with a fresh scalar head, the 1,000 shipped
  preference pairs) under a data-parallel plan: its accuracy on held-out pairs (prompts it never saw) climbs well
  above chance; the run's checkpoint exports as a LlamaForSequenceClassification that transformers loads, and
  transformers' scores of the held-out eval batches, put through the Bradley-Terry formula by hand, give the
  eval metrics the run reported.
- The same run's first iterations and first evaluation under a tensor-parallel plan: the same metrics within
  float tolerance.
- ``experiments/arith_ppo_rm.py`` with that export as its ``reward`` model: the PPO run's reward call scores
  the greedy answers of its evaluation with exactly what transformers gives for the exported model.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides

REPO = Path(__file__).resolve().parents[1]
RM = str(REPO / "experiments/arith_rm.py")
PPO = str(REPO / "experiments/arith_ppo_rm.py")
LEARN, EVERY, N_COMPARE = 96, 3, 3
# Every run spans the same learning-rate schedule (--schedule-iterations), so short runs take the long run's steps.
# lr 2e-3 rather than the experiment's 1e-3 over 300 iterations: a shorter run that still learns clearly.
COMMON = ("--schedule-iterations", str(LEARN), "--set", f"eval.every={EVERY}", "--set", "eval.batches=4",
          "--set", "rm.lr=2e-3")
PLANS = {"dp2": ("localhost", 2, 1, 1, 1), "tp2": ("localhost", 1, 2, 1, 2)}
KEYS = ("rm_loss", "rm_accuracy", "rm_margin", "rm_chosen", "rm_rejected", "rm_grad_norm")


def _run(experiment: str, placements: dict, iterations: int, run_dir: Path, *extra: str) -> list[dict]:
    spec = load_with_overrides(experiment, [extra[i + 1] for i, a in enumerate(extra) if a == "--set"])
    plan = ExecutionPlan.by_hand(build_graph(spec), placements, source=run_dir.name)
    plan.save(run_dir.with_suffix(".json"))
    cmd = [sys.executable, "-m", "realloc.cli", "run", experiment, "--plan", str(run_dir.with_suffix(".json")),
           "--iterations", str(iterations), "--run-dir", str(run_dir), "--quiet", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(run_dir.parent), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"{experiment}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """The shipped reward-model experiment on the dp=2 plan, checkpointed and exported at the end."""
    base = tmp_path_factory.mktemp("rm")
    metrics = _run(RM, {"rm_train": PLANS["dp2"]}, LEARN, base / "dp2", *COMMON, "--save-every", str(LEARN))
    out = base / "reward-hf"
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "export", str(base / "dp2"), "--model", "reward",
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    return base, metrics, out


def _hf_scores(model, seqs: list[list[int]]) -> list[float]:
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]


def _hf_scores_batched(model, seqs: list[list[int]]) -> list[float]:
    """``_hf_scores`` with the sequences of one length in one forward pass: transformers' trunk, then its score
    head on the last token (what LlamaForSequenceClassification reads for an unpadded row)."""
    out = [0.0] * len(seqs)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_length.setdefault(len(s), []).append(i)
    with torch.no_grad():
        for rows in by_length.values():
            hidden = model.model(input_ids=torch.tensor([seqs[i] for i in rows])).last_hidden_state
            for i, v in zip(rows, model.score(hidden[:, -1]).view(-1).tolist()):
                out[i] = v
    return out


def test_reward_model_learns_held_out_pairs_and_its_export_gives_the_reported_metrics(learned):
    from transformers import AutoModelForSequenceClassification

    from realloc.data.pairs import PreferenceDataset
    from realloc.data.tokenizer import Tokenizer
    from realloc.runtime.inputs.evaluation import EVAL_SEED

    _, metrics, export = learned
    evals = [(m["iteration"], m["eval"]) for m in metrics if "eval" in m]
    assert [i for i, _ in evals] == list(range(EVERY, LEARN + 1, EVERY))
    assert abs(metrics[0]["rm_loss"] - math.log(2)) < 0.05  # a fresh head: rewards near 0, loss near log 2
    first, last = evals[0][1], evals[-1][1]
    assert last["n"] == 4 * 32
    print("held-out accuracy", first["rm_accuracy"], "->", last["rm_accuracy"], "loss", first["rm_loss"], "->",
          last["rm_loss"])
    # Learning claims with wide margins (docs/machine-variance.md): the run's exact numbers differ between CPUs
    # (float rounding compounds over 96 Adam steps), measured 0.41-0.49 for the held-out loss and 1.7-2.4 for
    # the margin over three CPU instruction sets and four seeds. The held-out accuracy is checked below on 480 pairs.
    assert last["rm_loss"] < min(first["rm_loss"] - 0.1, 0.6) and last["rm_margin"] > 1.0

    # The reference: transformers on the exported model, the eval batches read as the workers read them.
    spec = load_experiment(RM)
    cfg = spec.config
    ds = PreferenceDataset.load(spec.resolve_path(cfg.eval.dataset), spec.prompt_len, spec.gen_len,
                                tokenizer=Tokenizer.load(str(spec.resolve_path(cfg.tokenizer))))
    hf = AutoModelForSequenceClassification.from_pretrained(str(export)).eval()
    chosen, rejected = [], []
    for j in range(4):
        b = ds.batch(j, spec.batch_size, EVAL_SEED)
        for i in range(spec.batch_size):
            p = int(b["prompt_lens"][i])
            chosen.append(b["chosen_tokens"][i, :p + int(b["chosen_mask"][i].sum())].tolist())
            rejected.append(b["rejected_tokens"][i, :p + int(b["rejected_mask"][i].sum())].tolist())
    c, r = (torch.tensor(_hf_scores_batched(hf, x), dtype=torch.float64) for x in (chosen, rejected))
    want = {"rm_loss": float(torch.log1p(torch.exp(-(c - r))).mean()), "rm_accuracy": float((c > r).double().mean()),
            "rm_margin": float((c - r).mean()), "rm_chosen": float(c.mean()), "rm_rejected": float(r.mean())}
    for k, v in want.items():
        assert last[k] == pytest.approx(v, abs=1e-4), k

    # Held-out accuracy on all 480 pairs of the shipped eval set (a run's 128 pairs alone vary by +-0.04 with the
    # sample): measured 0.69-0.75 over three CPU instruction sets and four seeds; chance is 0.5, and 0.62 on 480
    # pairs is 5 standard deviations above it.
    pairs = []
    for j in range(15):
        b = ds.batch(j, spec.batch_size, EVAL_SEED)
        for i in range(spec.batch_size):
            p = int(b["prompt_lens"][i])
            pairs += [b["chosen_tokens"][i, :p + int(b["chosen_mask"][i].sum())].tolist(),
                      b["rejected_tokens"][i, :p + int(b["rejected_mask"][i].sum())].tolist()]
    scores = _hf_scores_batched(hf, pairs)
    accuracy = sum(c > r for c, r in zip(scores[::2], scores[1::2])) / 480
    print("held-out accuracy on 480 pairs", accuracy)
    assert accuracy >= 0.62


def test_reward_model_metrics_do_not_depend_on_the_plan(learned):
    """dp=2 against tp=2 with two micro-batches (test_reward_model.py checks pp=2 in-process)."""
    base, dp2, _ = learned
    plan = "tp2"
    other = _run(RM, {"rm_train": PLANS[plan]}, N_COMPARE, base / plan, *COMMON)
    assert len(other) == N_COMPARE
    for a, b in zip(dp2[:N_COMPARE], other):
        for k in KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (plan, a["iteration"], k)
    for k in KEYS[:-1]:
        assert other[-1]["eval"][k] == pytest.approx(dp2[N_COMPARE - 1]["eval"][k], rel=1e-4, abs=1e-5), (plan, k)
    assert dp2[N_COMPARE - 1]["rm_margin"] != dp2[0]["rm_margin"]  # the model moved: not a degenerate comparison


def test_the_trained_reward_model_scores_a_ppo_run(learned):
    from transformers import AutoModelForSequenceClassification

    base, _, export = learned
    calls = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train", "exact_inf")
    one = {c: ("localhost:0", 1, 1, 1, 1) for c in calls}
    one.update({"rew_inf": ("localhost:1", 1, 1, 1, 1), "exact_inf": ("localhost", 2, 1, 1, 1)})
    metrics = _run(PPO, one, 2, base / "ppo", "--set", f"reward_model={export}", "--set", "eval.every=2",
                   "--set", "eval.batches=1")
    assert len(metrics) == 2 and "reward" in metrics[0] and "reward_exact_inf" in metrics[0]
    rows = [json.loads(line) for f in sorted(glob.glob(str(base / "ppo/eval/iter_00000002.rank*.jsonl")))
            for line in Path(f).read_text().splitlines()]
    assert len(rows) == 32 and metrics[1]["eval"]["n"] == 32
    hf = AutoModelForSequenceClassification.from_pretrained(str(export)).eval()
    want = _hf_scores(hf, [r["prompt"] + r["response"] for r in rows])
    assert [r["score"] for r in rows] == pytest.approx(want, abs=1e-4)
    assert metrics[1]["eval"]["reward"] == pytest.approx(sum(want) / len(want), abs=1e-4)
    # What it learned carries over: right answers score above wrong ones on average.
    right = [_answer(r["prompt_text"]) == r["response_text"].replace("<|eos|>", "") for r in rows]
    good, bad = [s for s, ok in zip(want, right) if ok], [s for s, ok in zip(want, right) if not ok]
    assert good and bad and sum(good) / len(good) > sum(bad) / len(bad)


def _answer(prompt_text: str) -> str:
    """The right answer to an arithmetic prompt such as "<|bos|>45-38=", as the task writes it."""
    a, op, b = re.fullmatch(r"(?:<\|bos\|>)?(\d+)([+-])(\d+)=", prompt_text).groups()
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))
