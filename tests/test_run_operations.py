"""One short ``realloc run`` checked for what issue 14 asks of a run (items 1-3, 7): overrides and the
learning-rate schedule reach the workers, TensorBoard gets every iteration, the eval set is evaluated
every N iterations (against HF transformers' greedy generation from the same checkpoint), iteration
numbers agree across console, metrics.jsonl, checkpoints, trace and worker logs, and ``realloc trace``
draws the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from run_helpers import REPO, TINY as EXPERIMENT, disjoint_plan

ITERATIONS = 4
# 4 iterations x 2 mini-batches = 8 optimizer steps; warmup round(0.25 * 8) = 2 steps, then cosine to 0
# over steps 2..7. Evaluation after iterations 2 and 4, each with a checkpoint of the same parameters.
SETS = ["ppo.lr=1e-3", "ppo.lr_schedule=cosine", "ppo.warmup_proportion=0.25", "eval.every=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("ops")
    disjoint_plan().save(base / "plan.json")
    run_dir = base / "run"
    cmd = [sys.executable, "-m", "realloc.cli", "run", EXPERIMENT, "--plan", str(base / "plan.json"),
           "--iterations", str(ITERATIONS), "--save-every", "2", "--run-dir", str(run_dir), "--quiet",
           *(x for s in SETS for x in ("--set", s))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(base), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, r.stdout, metrics


def test_overrides_and_the_schedule_reach_the_workers(run):
    _, out, metrics = run
    # Hand-computed: actor base 1e-3 (overridden), critic base 2e-3 (the file's); the lr of each iteration's
    # first optimizer step: step 0 (warmup 1/2), step 2 (decay starts at lr), steps 4 and 6 (cosine at 2/5, 4/5).
    factors = (0.5, 1.0, 0.5 * (1 + math.cos(math.pi * 2 / 5)), 0.5 * (1 + math.cos(math.pi * 4 / 5)))
    assert len(metrics) == len(factors)
    for m, factor in zip(metrics, factors):
        assert m["actor_lr"] == pytest.approx(1e-3 * factor) and m["critic_lr"] == pytest.approx(2e-3 * factor)
    assert "overrides: " + " ".join(SETS) in out
    assert json.loads((run[0] / "run.json").read_text())["overrides"] == SETS


def test_tensorboard_has_every_iteration(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, metrics = run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/kl", "train/actor_lr", "train/iteration_time", "time/actor_gen"} <= tags
    got = [(e.step, e.value) for e in events.Scalars("train/reward")]
    assert [s for s, _ in got] == [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([m["reward"] for m in metrics], rel=1e-6)


def test_iteration_numbers_agree_everywhere(run):
    run_dir, out, metrics = run
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    console = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("iter ")]
    assert console == ["iter 1/4", "iter 2/4", "iter 3/4", "iter 4/4"]
    assert f"plan from {run_dir.parent / 'plan.json'}" in out  # not "plan search"
    # --save-every 2: after iterations 2 and 4; each named after the iterations it holds.
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["iter_00000002", "iter_00000004"]
    assert json.loads((run_dir / "checkpoints/iter_00000002/meta.json").read_text())["next_iteration"] == 2
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    boxes = [e for e in events if e.get("ph") == "X"]
    assert {e["args"]["iteration"] for e in boxes if e["cat"] == "call"} == {1, 2, 3, 4}
    assert min(e["ts"] for e in boxes) >= 0
    requests = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert {r["iteration"] for r in requests if r["kind"] == "call"} == {1, 2, 3, 4}
    assert {r["iteration"] for r in requests if r["kind"] in ("setup", "shutdown")} == {0}


def test_worker_logs_say_what_the_worker_did(run):
    run_dir = run[0]
    for rank in (0, 1):
        text = (run_dir / "logs" / f"worker{rank}.log").read_text()
        assert "Transformer Engine" not in text and "Apex" not in text
        assert "actor layout localhost" in text  # both devices hold the actor's training layout
        assert "iteration 4 call actor_train" in text and "MiB resident" in text
    assert "iteration 1 call actor_gen" in (run_dir / "logs/worker0.log").read_text()
    assert "iteration 1 call critic_inf" in (run_dir / "logs/worker1.log").read_text()


def test_trace_draws_the_measured_run_beside_the_estimate(run, tmp_path, capsys):
    """`realloc trace RUN --timeline` (item 7): .png, and .html whose boxes name call, strategy and times."""
    import re

    from realloc.cli import main
    from realloc.search.timeline import MIN_WIDTH

    run_dir = run[0]
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    assert main(["trace", str(run_dir), "--timeline", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "measured, iterations 1..3" in out and "estimated, iterations 1..3" in out  # the default 1..3
    assert main(["trace", str(run_dir), "--timeline", str(page), "--iterations", "2..3"]) == 0
    text = page.read_text()
    # Hover text of a call box: its name, dp/tp/pp and micro-batches, iteration and times.
    assert "<title>actor_train (dp2 tp1 pp1, 1 mb)\niteration 2, call\n" in text
    assert "<title>critic_train (dp1 tp1 pp1, 1 mb)\niteration 3, call\n" in text
    # Only the asked iterations are drawn, and what iteration 1 still ran when they began, clipped to start then.
    assert all(t == "0.0000" for t in re.findall(r"iteration 1, call\n([\d.]+) s \.\.", text.split("estimated")[0]))
    assert text.count(">iteration 2</text>") == 2 and text.count(">iteration 3</text>") == 2  # both panels
    # Reallocations and transfers are there and never thinner than the minimum width.
    box = r"iteration \d+, (realloc|data)\n[^<]*</title><rect x=\"[\d.]+\" y=\"\d+\" width=\"([\d.]+)\""
    widths = [float(w) for _, w in re.findall(box, text)]
    assert len(widths) > 4 and min(widths) >= MIN_WIDTH * (1200 - 160) - 0.1
    assert main(["trace", str(run_dir), "--timeline", str(tmp_path / "t.pdf")]) == 2


def test_eval_set_every_n_iterations_matches_transformers_greedy(run):
    """Evaluation after iterations 2 and 4 (eval.every=2): greedy responses to the eval prompts are what HF
    transformers generates greedily from the checkpoint of the same iteration, and the logged eval reward
    is the task's rule applied to them."""
    import glob

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from realloc.data.prompts import PromptDataset
    from realloc.models.config import get_model_config
    from realloc.models.hf_io import hf_config_from_model_config
    from realloc.runtime.inputs.evaluation import EVAL_SEED

    run_dir, out, metrics = run
    assert [m["iteration"] for m in metrics if "eval" in m] == [2, 4]
    console = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("iter ")}
    assert "eval reward" in console["iter 2/4"] and "eval reward" not in console["iter 3/4"]
    eval_prompts = PromptDataset.load(REPO / "experiments/data/ppo_tiny_eval.jsonl", 8).batch(0, 32, EVAL_SEED)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_from_model_config(get_model_config("tiny")))).eval()
    target = set(range(16, 32))  # experiments/ppo_tiny.py's rule: the share of response tokens in the set
    for m in metrics[1::2]:
        t = m["iteration"]
        rows = sorted((json.loads(x) for f in glob.glob(str(run_dir / f"eval/iter_{t:08d}.rank*.jsonl"))
                       for x in open(f)), key=lambda r: r["row"])
        assert [r["row"] for r in rows] == list(range(32)) and m["eval"]["n"] == 32 and m["eval"]["greedy"]
        prompts = torch.tensor([r["prompt"] for r in rows])
        assert torch.equal(prompts, eval_prompts["tokens"])  # the eval set, in its fixed order
        shard = load_file(run_dir / f"checkpoints/iter_{t:08d}/models/actor/tp0_pp0.safetensors")
        hf.load_state_dict({k.removeprefix("param/"): v for k, v in shard.items() if k.startswith("param/")})
        with torch.no_grad():
            ref = hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 8:]
        assert [r["response"] for r in rows] == ref.tolist(), t
        scores = [sum(tok in target for tok in r["response"]) / 8 for r in rows]
        assert [r["score"] for r in rows] == pytest.approx(scores)
        assert m["eval"]["reward"] == pytest.approx(sum(scores) / 32)


@pytest.fixture(scope="module")
def resumed(run, tmp_path_factory):
    """A copy of the run resumed from its checkpoint after iteration 2 with more iterations (5) than the first
    run's schedule (4), and sampled evaluation (eval.greedy=false, a changed setting: --allow-changed-settings).
    The first run's overrides are not given again: --resume reapplies them. No --save-every: the final state is
    saved, and --keep-checkpoints 2 leaves two."""
    import shutil

    base = tmp_path_factory.mktemp("resumed")
    run_dir = base / "run"
    shutil.copytree(run[0], run_dir)
    cmd = [sys.executable, "-m", "realloc.cli", "run", EXPERIMENT, "--resume", str(run_dir / "checkpoints/iter_00000002"),
           "--iterations", "5", "--run-dir", str(run_dir), "--quiet", "--set", "eval.greedy=false",
           "--allow-changed-settings", "--keep-checkpoints", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(base), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, r.stdout, metrics


def test_a_resumed_run_keeps_the_checkpoints_schedule(run, resumed):
    """Resuming with more iterations continues the schedule the checkpoint was on (horizon 4, saved in
    meta.json): iterations 3 and 4 train with the first run's learning rates, iteration 5 with its last one."""
    _, _, first = run
    run_dir, out, metrics = resumed
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5]
    assert json.loads((run[0] / "checkpoints/iter_00000002/meta.json").read_text())["schedule_iterations"] == 4
    for m, ref in zip(metrics[2:4], first[2:4]):
        assert (m["actor_lr"], m["critic_lr"]) == (ref["actor_lr"], ref["critic_lr"])
        assert m["reward"] == pytest.approx(ref["reward"], rel=1e-6)  # the same training, resumed
    assert (metrics[4]["actor_lr"], metrics[4]["critic_lr"]) == (0.0, 0.0)  # cosine's end: min_lr_ratio 0
    assert ("learning-rate schedule over iterations 1..4 (the checkpoint); iterations 5..5 keep its last learning "
            "rate") in out
    assert f"metrics also to: tensorboard {run_dir / 'tensorboard'}" in out


def test_a_resumed_run_does_not_repeat_tensorboard_steps(resumed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, metrics = resumed
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 2  # the first run's file and the resumed one's
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/actor_lr")]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]  # steps 3 and 4 of the first run were purged
    assert [v for _, v in got] == pytest.approx([m["actor_lr"] for m in metrics], rel=1e-6)
    assert "train/tokens" not in events.Tags()["scalars"]  # a constant of the run: metrics.jsonl only


def test_sampled_eval_scores_sampled_responses(run, resumed):
    """eval.greedy=false: the eval after iteration 4 samples (the responses are not the greedy ones the first
    run's eval produced from the same parameters), and its reward is the rule applied to those samples."""
    import glob

    run_dir, _, metrics = resumed
    m = metrics[3]
    assert m["iteration"] == 4 and m["eval"]["greedy"] is False and m["eval"]["n"] == 32

    def rows(d):
        return sorted((json.loads(x) for f in glob.glob(str(d / "eval/iter_00000004.rank*.jsonl")) for x in open(f)),
                      key=lambda r: r["row"])

    sampled, greedy = rows(run_dir), rows(run[0])
    assert [r["prompt"] for r in sampled] == [r["prompt"] for r in greedy]
    assert sum(r["response"] != g["response"] for r, g in zip(sampled, greedy)) > 16
    target = set(range(16, 32))  # experiments/ppo_tiny.py's rule
    scores = [sum(tok in target for tok in r["response"]) / 8 for r in sampled]
    assert [r["score"] for r in sampled] == pytest.approx(scores)
    assert m["eval"]["reward"] == pytest.approx(sum(scores) / 32)
    # The resumed run's eval rows of iteration 4 replaced the first run's (32 rows above, not 64), and
    # samples.jsonl holds no iteration twice.
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    keys = [(s["iteration"], s.get("key", "seq"), s["seq"]) for s in samples]
    assert samples and len(keys) == len(set(keys))


def test_a_run_records_its_resolved_settings_and_data(run):
    run_dir = run[0]
    resolved = json.loads((run_dir / "config/experiment.json").read_text())
    assert resolved["config"]["ppo"]["lr"] == 1e-3 and resolved["config"]["ppo"]["lr_schedule"] == "cosine"
    assert resolved["config"]["ppo"]["clip_eps"] == 0.2  # a default, recorded too
    assert (run_dir / "config/source/ppo_tiny.py").read_bytes() == (REPO / "experiments/ppo_tiny.py").read_bytes()
    meta = json.loads((run_dir / "checkpoints/iter_00000004/meta.json").read_text())
    assert meta["settings"]["overrides"] == SETS and meta["settings"]["experiment"] == resolved
    data = json.loads((run_dir / "data.json").read_text())
    assert data["gen_len"] == 8 and data["has_responses"] is False  # ppo_tiny's gen_len, a prompt dataset


def test_a_resumed_run_reapplies_its_settings_keeps_its_history_and_exports(run, resumed, tmp_path, capsys):
    """Issue 22, items 8, 9 and 11: the resumed run trained with the first run's overrides (the schedule test
    above), said so, recorded its session beside the first one, saved its final state without --save-every,
    kept the newest 2 checkpoints, appended to requests.jsonl and trace.json, and `realloc export RUN_DIR` and
    `realloc trace RUN_DIR` read it with no more flags."""
    from realloc.cli import main

    run_dir, out, _ = resumed
    assert "reapplied the checkpoint's run's overrides: " + " ".join(SETS) in out
    assert "settings changed from the checkpoint's run (--allow-changed-settings): eval.greedy: true -> false" in out
    recorded = json.loads((run_dir / "run.json").read_text())
    assert recorded["overrides"] == [*SETS, "eval.greedy=false"]
    first, second = recorded["sessions"]
    assert first["given"] == SETS and first["resumed_from"] is None and first["iterations"] == [1, 4]
    assert second["given"] == ["eval.greedy=false"] and second["changed"] == ["eval.greedy: true -> false"]
    assert second["resumed_from"].endswith("checkpoints/iter_00000002") and second["iterations"] == [3, 5]
    # The first run's iteration 4 is the history this run replaced: set aside, not taken for this run's own
    # (test_audit_round7.py); the newest 2 of this run's are the checkpoint it resumed from and its final state.
    (aside,) = (run_dir / "checkpoints").glob("replaced-*")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_00000002", "iter_00000005"]
    assert [p.name for p in aside.iterdir()] == ["iter_00000004"] and f"moved to {aside}" in out
    meta = json.loads((run_dir / "checkpoints/iter_00000005/meta.json").read_text())
    assert meta["settings"]["overrides"] == [*SETS, "eval.greedy=false"]

    assert main(["export", str(run_dir), "--model", "actor", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf/realloc_export.json").read_text())["iteration"] == 5

    requests = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    calls = sorted({(r["session"], r["iteration"]) for r in requests if r["kind"] == "call"})
    assert calls == [(1, 1), (1, 2), (2, 3), (2, 4), (2, 5)]  # the first run's 3 and 4 were done again
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    (marker,) = [e for e in events if e["ph"] == "i"]
    boxes = [e for e in events if e["ph"] == "X" and e["cat"] == "call"]
    assert {e["args"]["iteration"] for e in boxes if e["ts"] < marker["ts"]} == {1, 2}
    assert {e["args"]["iteration"] for e in boxes if e["ts"] > marker["ts"]} == {3, 4, 5}
    capsys.readouterr()
    assert main(["trace", str(run_dir), "--timeline", str(tmp_path / "t.svg"), "--iterations", "1..5",
                 "--no-estimate"]) == 0
    assert "measured, iterations 1..5" in capsys.readouterr().out
