"""`realloc run` of PPO from Phi-3, Gemma and windowed Qwen2 checkpoints on 4 local CPU devices, then the export.

test_runtime_hf_e2e.py's experiment and plans with the families of test_model_families2.py: the actor and reference
start from a tiny Phi-3 checkpoint (fused qkv_proj / gate_up_proj, a 12-token sliding window, half of each head's
features rotated), the critic from a Gemma sequence classifier ((1 + w) norms, scaled embeddings, gelu) and the
reward is a Qwen2 sequence classifier with a 10-token window in its layers 2 and 3 (of 4). Checked, as there: the
same metrics on one device and at tp=2/pp=2 with reallocation between layouts; iteration 1's samples are
transformers' greedy tokens with its log-probs and rewards; the models exported after the tp=2/pp=2 run load in
transformers as Phi3ForCausalLM and GemmaForSequenceClassification, with realloc's logits and values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_families_e2e import check_samples_and_rewards
from test_runtime_hf_e2e import HEADLINE, ITERS, Runs, _metrics, check_export_against_shards, write_experiment


def _patch(path: Path, **keys) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **keys}))


@pytest.fixture(scope="module")
def experiment(hf_assets, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families2_e2e")
    shutil.copytree(hf_assets.checkpoint("qwen2", arch="phi3"), root / "actor")
    _patch(root / "actor", sliding_window=12,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    shutil.copytree(hf_assets.checkpoint("llama_reward", arch="gemma"), root / "critic")
    shutil.copytree(hf_assets.checkpoint("qwen2_reward"), root / "reward")
    _patch(root / "reward", use_sliding_window=True, sliding_window=10, max_window_layers=2, layer_types=None)
    return write_experiment(root)


@pytest.fixture(scope="module")
def runs(experiment) -> Runs:
    return Runs(experiment)


def test_read_as_the_families_with_their_features(experiment):
    from realloc.models.hf_io import model_config_from_hf

    root = experiment.parent
    actor, critic, reward = (model_config_from_hf(root / n) for n in ("actor", "critic", "reward"))
    assert (actor.family, actor.sliding_window, actor.rotary_dim) == ("phi3", 12, 8)
    assert (critic.family, critic.norm_plus_one, critic.hidden_act) == ("gemma", True, "gelu_pytorch_tanh")
    assert (reward.family, reward.sliding_window, reward.full_attention_layers) == ("qwen2", 10, (0, 1))


def check_same_metrics(runs: Runs) -> None:
    """The one-device run's and the tp=2/pp=2 run's headline metrics agree, and training moved the policy."""
    ref, got = _metrics(runs["one_device"]), _metrics(runs["tp2pp2"])
    assert len(ref) == len(got) == ITERS
    for a, b in zip(ref, got):
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["iteration"], k)
    assert ref[-1]["kl"] > 1e-3  # training moved the policy: not a degenerate comparison


def test_same_metrics_on_one_device_and_at_tp2_pp2(runs):
    check_same_metrics(runs)


def test_samples_and_rewards_match_transformers(runs, experiment):
    first = check_samples_and_rewards(runs["one_device"], experiment.parent,
                                      ("Phi3ForCausalLM", "Qwen2ForSequenceClassification"))
    assert max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in first) > 12  # the windows bind


def test_export_after_tp2_pp2_loads_as_its_family_with_the_checkpoints_outputs(runs, experiment, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    run, root = runs["tp2pp2"], experiment.parent
    exported = run / "exports" / f"iter_{ITERS:08d}"
    ckpt = run / "checkpoints" / f"iter_{ITERS:08d}"
    actor = AutoModelForCausalLM.from_pretrained(exported / "actor").eval()
    critic = AutoModelForSequenceClassification.from_pretrained(exported / "critic").eval()
    assert (type(actor).__name__, type(critic).__name__) == ("Phi3ForCausalLM", "GemmaForSequenceClassification")
    assert actor.config.sliding_window == 12 and actor.config.rope_parameters["partial_rotary_factor"] == 0.5
    start = AutoModelForCausalLM.from_pretrained(root / "actor")
    assert set(actor.state_dict()) == set(start.state_dict())  # the fused names, nothing else
    moved = (actor.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
             - start.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]).abs().max().item()
    assert moved > 1e-5
    check_export_against_shards(ckpt, root, actor, critic, tmp_path)
