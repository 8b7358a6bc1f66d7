"""The tool demo's pieces (realloc/demo/calc_task.py, experiments/calc_*.py), without training: the shipped files
are what the task module makes, and the SFT traces are conversations the experiment's tool environment would
have produced."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from realloc.demo import calc_task
from realloc.envs.base import env_factory

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "experiments" / "data"


def test_shipped_files_are_what_the_task_makes():
    for name, text in calc_task.files().items():
        assert (DATA / name).read_text() == text, name
    records = [json.loads(line) for line in (DATA / calc_task.EVAL_FILE).read_text().splitlines()]
    for rec in records[:20]:
        a, b = rec["prompt"].rstrip("=").split("*")
        assert 100 <= int(a) <= 999 and 10 <= int(b) <= 99 and rec["answer"] == str(int(a) * int(b))
    eval_prompts = {r["prompt"] for r in records}
    sft = [json.loads(line)["prompt"] for line in (DATA / calc_task.SFT_TOOL_FILE).read_text().splitlines()]
    assert not eval_prompts & set(sft)  # held out


def test_sft_traces_are_conversations_of_the_experiments_tool_environment():
    spec = importlib.util.spec_from_file_location("calc_grpo_tool", REPO / "experiments" / "calc_grpo_tool.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env_args = module.ENV
    for line in (DATA / calc_task.SFT_TOOL_FILE).read_text().splitlines()[:3]:
        rec = json.loads(line)
        call, rest = rec["response"].split(calc_task.EOS_TEXT)
        answer = rec["response"].rsplit(">", 1)[1]
        env = env_factory("test", env_args["env"])(**env_args["env_args"])
        env.reset({"answer": answer})
        obs, reward, done = env.step(call)
        assert (rest, reward, done) == (obs + answer, 0.0, False)
        assert env.step(answer) == (None, 1.0, True)


def test_pick_sft_keeps_the_first_checkpoint_past_the_target_by_bisection(monkeypatch, tmp_path):
    from realloc.demo import calc_demo

    def share(it: int) -> float:  # a jump between 140 and 175, as the tool SFT run's sampled accuracy makes
        return 0.0 if it < 140 else min(0.9, (it - 135) / 40)

    probed = []

    def fake_export(run_dir, out, iteration=None):
        probed.append(iteration)
        return iteration

    def fake_accuracy(it, use_tool, limit, dataset, temperature, samples):
        assert (use_tool, dataset, temperature) == (True, calc_task.TRAIN_FILE, calc_demo.PROBE_TEMPERATURE)
        return calc_demo.Score(100, round(100 * share(it)), 0, ())

    monkeypatch.setattr(calc_demo, "_export", fake_export)
    monkeypatch.setattr(calc_demo, "tool_accuracy", fake_accuracy)
    every = range(calc_demo.SFT_FIRST, calc_demo.SFT_MAX_ITERATIONS + 1, calc_demo.SFT_EVERY)
    for target in (0.1, 0.5, 0.0, 0.95):
        probed.clear()
        it, got = calc_demo.pick_sft(tmp_path, tmp_path, target)
        brute = next((i for i in every if round(100 * share(i)) / 100 >= target), calc_demo.SFT_MAX_ITERATIONS)
        assert it == brute and got == round(100 * share(it)) / 100
        assert len(set(probed)) <= 2 + len(every).bit_length()  # a bisection, not a scan
