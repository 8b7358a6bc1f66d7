"""`realloc run` of PPO from Qwen3 and Mistral checkpoints on 4 local CPU devices, then `realloc export`.

test_runtime_hf_e2e.py's experiment and plans with other families: the actor and reference start from a tiny
tied Qwen3 checkpoint (per-head q/k norms), the critic from a Mistral sequence classifier with a 12-token
sliding window (shorter than the rows) and the reward is a Qwen3 sequence classifier. Checked, as there: the same
metrics on one device and with tp=2/pp=2 training and reallocation between layouts; iteration 1's samples are
transformers' greedy tokens with its log-probs and rewards; the models exported after the tp=2/pp=2 run load in
transformers as the families they came from, and their logits and values equal realloc's from the run's own
checkpoint shards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_runtime_hf_e2e import (HEADLINE, ITERS, Runs, _check_against_transformers, _metrics, _samples,
                                 check_export_against_shards, write_experiment)


WINDOW = 12  # the critic's sliding window: prompts of up to 24 tokens and 8 generated go past it


@pytest.fixture(scope="module")
def experiment(hf_assets, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families_e2e")
    shutil.copytree(hf_assets.checkpoint("qwen2", arch="qwen3", tie=True), root / "actor")
    shutil.copytree(hf_assets.checkpoint("llama_reward", arch="mistral"), root / "critic")
    config = json.loads((root / "critic/config.json").read_text())
    (root / "critic/config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    shutil.copytree(hf_assets.checkpoint("qwen2_reward", arch="qwen3"), root / "reward")
    return write_experiment(root)


@pytest.fixture(scope="module")
def runs(experiment) -> Runs:
    return Runs(experiment)


def test_same_metrics_on_one_device_and_at_tp2_pp2(runs):
    ref, got = _metrics(runs["one_device"]), _metrics(runs["tp2pp2"])
    assert len(ref) == len(got) == ITERS
    for a, b in zip(ref, got):
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["iteration"], k)
    assert ref[-1]["kl"] > 1e-3  # training moved the policy: not a degenerate comparison
    assert abs(ref[0]["approx_kl"]) < 1e-5  # the first update starts at ratio 1


def check_samples_and_rewards(run: Path, root: Path, classes: tuple[str, str]) -> list[dict]:
    """Iteration 1's samples of ``run`` are transformers' greedy tokens and log-probs of ``root``/actor, and their
    rewards ``root``/reward's scores; ``classes``: the two models' transformers classes. Returns the samples."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    actor = AutoModelForCausalLM.from_pretrained(root / "actor").eval()
    reward = AutoModelForSequenceClassification.from_pretrained(root / "reward").eval()
    assert (type(actor).__name__, type(reward).__name__) == classes
    eos = json.loads((root / "actor/generation_config.json").read_text())["eos_token_id"]
    first = _samples(run, 1)
    _check_against_transformers(first, actor, eos)
    for s in first:
        with torch.no_grad():
            score = reward(input_ids=torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0, 0]
        assert s["reward"] == pytest.approx(float(score), abs=1e-4)
    return first


def test_samples_and_rewards_match_transformers(runs, experiment):
    check_samples_and_rewards(runs["one_device"], experiment.parent,
                              ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"))


def test_export_after_tp2_pp2_loads_as_its_family_with_the_checkpoints_outputs(runs, experiment, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run, root = runs["tp2pp2"], experiment.parent
    exported = run / "exports" / f"iter_{ITERS:08d}"
    ckpt = run / "checkpoints" / f"iter_{ITERS:08d}"
    actor = AutoModelForCausalLM.from_pretrained(exported / "actor").eval()
    critic = AutoModelForSequenceClassification.from_pretrained(exported / "critic").eval()
    assert (type(actor).__name__, type(critic).__name__) == ("Qwen3ForCausalLM", "MistralForSequenceClassification")
    assert actor.config.tie_word_embeddings and actor.config.sliding_window is None
    assert critic.config.sliding_window == WINDOW
    start = AutoModelForCausalLM.from_pretrained(root / "actor")
    norms = [n for n in start.state_dict() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 8  # 4 layers; and training moved them
    assert max((actor.state_dict()[n] - start.state_dict()[n]).abs().max().item() for n in norms) > 1e-5
    check_export_against_shards(ckpt, root, actor, critic, tmp_path)
