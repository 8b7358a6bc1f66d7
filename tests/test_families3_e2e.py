"""`realloc run` of PPO from Gemma 3 and Gemma 2 checkpoints on 4 local CPU devices, then the export.

test_runtime_hf_e2e.py's experiment and plans with the families of test_model_families3.py: the actor and reference
start from a tiny Gemma3ForCausalLM (layers 0 and 2 windowed to 12 tokens with RoPE base 1e4, 1 and 3 full with base
1e6, query_pre_attn_scalar 8), the critic from a Gemma 2 sequence classifier (attention scores capped at 3, layer 0
windowed to 10 tokens) and the reward is a Gemma 3 sequence classifier. Checked, as there: the same metrics on one
device and at tp=2/pp=2 with reallocation between layouts; iteration 1's samples are transformers' greedy tokens with
its log-probs and rewards; the models exported after the tp=2/pp=2 run load in transformers as Gemma3ForCausalLM
and Gemma2ForSequenceClassification, with realloc's logits and values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_families2_e2e import _patch, check_same_metrics
from test_families_e2e import check_samples_and_rewards
from test_runtime_hf_e2e import ITERS, Runs, check_export_against_shards, write_experiment

GEMMA3_KEYS = dict(sliding_window=12, query_pre_attn_scalar=8,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _gemma3(path: Path) -> None:
    """Even layers windowed, odd ones full, each with its RoPE base."""
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    _patch(path, **GEMMA3_KEYS, layer_types=["sliding_attention", "full_attention"] * (layers // 2))


@pytest.fixture(scope="module")
def experiment(hf_assets, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families3_e2e")
    shutil.copytree(hf_assets.checkpoint("qwen2", arch="gemma3"), root / "actor")
    _gemma3(root / "actor")
    shutil.copytree(hf_assets.checkpoint("llama_reward", arch="gemma2"), root / "critic")
    _patch(root / "critic", sliding_window=10, attn_logit_softcapping=3.0)
    shutil.copytree(hf_assets.checkpoint("qwen2_reward", arch="gemma3"), root / "reward")
    _gemma3(root / "reward")
    return write_experiment(root)


@pytest.fixture(scope="module")
def runs(experiment) -> Runs:
    return Runs(experiment)


def test_read_as_the_families_with_their_features(experiment):
    from realloc.models.hf_io import model_config_from_hf

    root = experiment.parent
    actor, critic, reward = (model_config_from_hf(root / n) for n in ("actor", "critic", "reward"))
    assert (actor.family, actor.sliding_window, actor.full_attention_layers, actor.local_rope_theta,
            actor.query_pre_attn_scalar) == ("gemma3_text", 12, (1, 3), 1e4, 8.0)
    assert (critic.family, critic.sliding_window, critic.attn_logit_softcapping) == ("gemma2", 10, 3.0)
    assert (reward.family, reward.is_critic, reward.sandwich_norms) == ("gemma3_text", True, True)


def test_same_metrics_on_one_device_and_at_tp2_pp2(runs):
    check_same_metrics(runs)


def test_samples_and_rewards_match_transformers(runs, experiment):
    first = check_samples_and_rewards(runs["one_device"], experiment.parent,
                                      ("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification"))
    assert max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in first) > 12  # the windows bind


def test_export_after_tp2_pp2_loads_as_its_family_with_the_checkpoints_outputs(runs, experiment, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run, root = runs["tp2pp2"], experiment.parent
    exported = run / "exports" / f"iter_{ITERS:08d}"
    ckpt = run / "checkpoints" / f"iter_{ITERS:08d}"
    actor = AutoModelForCausalLM.from_pretrained(exported / "actor").eval()
    critic = AutoModelForSequenceClassification.from_pretrained(exported / "critic").eval()
    assert (type(actor).__name__, type(critic).__name__) == ("Gemma3ForCausalLM", "Gemma2ForSequenceClassification")
    assert actor.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert actor.config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert critic.config.attn_logit_softcapping == 3.0
    check_export_against_shards(ckpt, root, actor, critic, tmp_path)
