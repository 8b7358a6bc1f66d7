"""Models declared by HF checkpoint path: the graph reads their shape, validation errors are one line.

Every case writes an experiment file into a temp directory next to tiny config.json-only
checkpoints (the graph never reads weights), then runs ``realloc show`` or ``build_graph`` on it.
``realloc show`` also reads the safetensors headers: a case that passes it gets weights saved by transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.api import HFModel, load_experiment
from realloc.graph.dataflow import build_graph
from realloc.search.candidates import call_options

REPO = Path(__file__).resolve().parents[1]

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
         "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
         "hidden_act": "silu"}
REWARD = {**LLAMA, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1,
          "tie_word_embeddings": False, "num_hidden_layers": 2}


def _write_ckpt(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


EXPERIMENT = """
import dataclasses
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, HFModel, ModelFunctionCallDef, auto

IN = ["seq", "logp", "ref_logp", "rewards", "values"]

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Exp:
    @property
    def models(self):
        return {MODELS}

    @property
    def rpcs(self):
        return [
            ModelFunctionCallDef(name="actor_gen", model_name="actor", interface_type=GENERATE,
                                 interface_impl="ppo_actor", input_data=["prompts"], output_data=["seq", "logp"]{ACTOR_TYPE}),
            ModelFunctionCallDef(name="rew_inf", model_name="reward", interface_type=INFERENCE,
                                 interface_impl="reward", input_data=["seq"], output_data=["rewards"]),
            ModelFunctionCallDef(name="ref_inf", model_name="ref", interface_type=INFERENCE,
                                 interface_impl="ppo_actor", input_data=["seq"], output_data=["ref_logp"]),
            ModelFunctionCallDef(name="critic_inf", model_name="critic", interface_type=INFERENCE,
                                 interface_impl="ppo_critic", input_data=["seq"], output_data=["values"]),
            ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                 interface_impl="ppo_actor", input_data=IN),
            ModelFunctionCallDef(name="critic_train", model_name="critic", interface_type=TRAIN_STEP,
                                 interface_impl="ppo_critic", input_data=IN),
        ]
"""
GOOD = ('{"actor": "ckpt/sft", "ref": "ckpt/sft", "critic": HFModel("ckpt/sft", new_value_head=True), '
        '"reward": "ckpt/rm"}')


def _experiment(tmp: Path, models: str = GOOD, actor_type: str = "") -> Path:
    _write_ckpt(tmp / "ckpt/sft", LLAMA)
    _write_ckpt(tmp / "ckpt/rm", REWARD)
    f = tmp / "exp.py"
    f.write_text(EXPERIMENT.replace("{MODELS}", models).replace("{ACTOR_TYPE}", actor_type))
    return f


def _show(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realloc.cli", "show", str(path)], capture_output=True, text=True,
                          cwd=path.parent, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_shapes_come_from_config_json(tmp_path):
    graph = build_graph(load_experiment(str(_experiment(tmp_path))))
    actor, critic, reward = (graph.model_config(c) for c in ("actor_gen", "critic_inf", "rew_inf"))
    assert (actor.vocab_size, actor.n_layers, actor.n_kv_heads, actor.tie_embeddings) == (96, 3, 2, True)
    assert not actor.is_critic
    # The critic starts from the causal LM: same trunk, a scalar head, no tying.
    assert critic.is_critic and not critic.tie_embeddings and critic.n_layers == 3
    assert reward.is_critic and reward.n_layers == 2
    assert graph.spec.models["critic"].new_value_head
    assert Path(graph.spec.models["actor"].path) == (tmp_path / "ckpt/sft").resolve()
    # The planner enumerates layouts for it: pp up to its 3 layers, never 4.
    pps = {opt.strategy.pp for opt in call_options(graph, "actor_train")}
    assert 3 not in pps and max(pps) <= 2 and pps  # 2 devices


def test_a_vocabulary_tp_does_not_divide_is_planned_at_every_tp(tmp_path):
    """A checkpoint with 97 tokens (issue 11): the engine pads its vocabulary to 100 rows, so the planner offers
    tp=2 (before, tp had to divide 97). Shapes reported from config.json stay the checkpoint's."""
    f = _experiment(tmp_path)
    _write_ckpt(tmp_path / "ckpt/sft", dict(LLAMA, vocab_size=97))
    _write_ckpt(tmp_path / "ckpt/rm", dict(REWARD, vocab_size=97))
    graph = build_graph(load_experiment(str(f)))
    actor = graph.model_config("actor_train")
    assert (actor.vocab_size, actor.padded_vocab_size) == (97, 100)
    for call in ("actor_gen", "actor_train", "critic_train", "rew_inf"):
        assert {opt.strategy.tp for opt in call_options(graph, call)} == {1, 2}, call


def test_digest_names_shapes_not_paths(tmp_path):
    a = build_graph(load_experiment(str(_experiment(tmp_path / "a"))))
    b = build_graph(load_experiment(str(_experiment(tmp_path / "b"))))
    assert a.digest == b.digest
    bigger = dict(LLAMA, num_hidden_layers=4)
    _write_ckpt(tmp_path / "b/ckpt/sft", bigger)
    c = build_graph(load_experiment(str(tmp_path / "b/exp.py")))
    assert c.digest != a.digest


def _add_weights(path: Path) -> None:
    """Random weights for the config.json in ``path``, saved by transformers (show checks their headers)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = AutoConfig.from_pretrained(path)
    seq_cls = cfg.architectures[0].endswith("ForSequenceClassification")
    (AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM).from_config(cfg).save_pretrained(path)


def test_show_prints_checkpoint_models(tmp_path):
    f = _experiment(tmp_path)
    for ckpt in ("sft", "rm"):
        _add_weights(tmp_path / "ckpt" / ckpt)
    r = _show(f)
    assert r.returncode == 0, r.stderr
    assert "actor(hf:sft)" in r.stdout and "critic(hf:sft+value-head)" in r.stdout and "reward(hf:rm)" in r.stdout


@pytest.mark.parametrize("models, actor_type, words", [
    ('{"actor": "ckpt/missing", "ref": "ckpt/sft", "critic": HFModel("ckpt/sft", new_value_head=True), '
     '"reward": "ckpt/rm"}', "", ["actor", "ckpt/missing", "does not exist"]),
    (GOOD.replace('HFModel("ckpt/sft", new_value_head=True)', '"ckpt/sft"'), "",
     ["critic", "critic_inf", "scalar value head", "new_value_head=True"]),
    (GOOD.replace('"ref": "ckpt/sft"', '"ref": "ckpt/rm"'), "", ["ref", "ref_inf", "vocabulary", "scalar head"]),
    (GOOD.replace('"reward": "ckpt/rm"', '"reward": HFModel("ckpt/rm", new_value_head=True)'), "",
     ["reward", "already a sequence-classification", "new_value_head"]),
    (GOOD, ', model_type="tiny"', ["actor", "actor_gen", "model_type", "drop one"]),
    (GOOD[:-1] + ', "actr": "ckpt/sft"}', "", ["actr", "no call uses"]),
    (GOOD.replace('"ckpt/rm"', '"ckpt/gpt2"'), "", ["gpt2"]),
    (GOOD.replace('"ckpt/rm"', '"ckpt/noconfig"'), "", ["config.json"]),
    ('["ckpt/sft"]', "", ["models", "must map"]),
])
def test_bad_models_are_one_clear_error(tmp_path, models, actor_type, words):
    f = _experiment(tmp_path, models, actor_type)
    _write_ckpt(tmp_path / "ckpt/gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                         "vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 4})
    (tmp_path / "ckpt/noconfig").mkdir()
    r = _show(f)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_hfmodel_validates_its_fields():
    with pytest.raises(ValueError, match="path"):
        HFModel("")
    with pytest.raises(ValueError, match="new_value_head"):
        HFModel("x", new_value_head="yes")  # type: ignore[arg-type]


def test_relative_paths_follow_the_experiment_file(tmp_path):
    f = _experiment(tmp_path / "exps")
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "exps", moved)
    spec = load_experiment(str(moved / "exp.py"))
    assert Path(spec.models["reward"].path) == (moved / "ckpt/rm").resolve()
    assert f.exists()
