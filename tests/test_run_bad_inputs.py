"""Bad models, tokenizers and prompt files stop `realloc run` (and `realloc show`) in one line, before any worker.

Each case edits one thing of a working HF/text experiment. The command must exit 2 with one line
on stderr that names the culprit, print no traceback, and leave no run directory with worker logs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = '''
import dataclasses
from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import HFModel, auto
from realloc.data.config import DataConfig

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=16, gen_len=4)
@dataclasses.dataclass
class Exp:
    dataset: str = "{DATASET}"
    tokenizer: str = "{TOKENIZER}"
    iterations: int = 1
    data: DataConfig = DataConfig({DATA})

    @property
    def models(self):
        return {{"actor": "{ACTOR}", "ref": "{ACTOR}", "critic": HFModel("{ACTOR}", new_value_head=True),
                "reward": "{REWARD}"}}

    @property
    def rpcs(self):
        return ppo_rpcs(n_minibatches=1)
'''


@pytest.fixture(scope="module")
def assets(hf_assets, tmp_path_factory):
    from realloc.tiny_assets.hf import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("bad")
    small = make_tiny_checkpoint(root / "small", vocab_size=300, hidden=64, heads=4, kv_heads=2)  # tokenizer: 500
    (root / "notok").mkdir()
    (root / "prompts.jsonl").write_text('{"prompt": "What is 2 plus 2?"}\n{"prompt": "Say hi."}\n')
    (root / "wrongcol.jsonl").write_text('{"question": "What is 2 plus 2?"}\n')
    (root / "empty.jsonl").write_text("\n")
    (root / "long.jsonl").write_text(json.dumps({"prompt": "word " * 40}) + "\n")
    (root / "ids.jsonl").write_text('{"prompt": [1, 2, 999]}\n')
    qwen3 = root / "qwen3"
    shutil.copytree(hf_assets.checkpoint("llama"), qwen3)
    cfg = json.loads((qwen3 / "config.json").read_text())
    (qwen3 / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    actor, reward = hf_assets.checkpoint("llama"), hf_assets.checkpoint("llama_reward")
    _bad_checkpoints(root, actor, reward)
    return {"root": root, "tok": hf_assets.tokenizer, "actor": actor, "reward": reward, "small": small,
            "qwen3": qwen3}


def _patched(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _bad_checkpoints(root: Path, actor: Path, reward: Path) -> None:
    """Checkpoints whose config.json reads fine but whose weights a worker could not load, and configs a run
    cannot use; each broken in one way."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    # A reward model saved by transformers with its default label count: config.json names no labels.
    cfg = AutoConfig.from_pretrained(reward)
    cfg_dict = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id", "num_labels")}
    two = AutoModelForSequenceClassification.from_config(type(cfg)(**cfg_dict))
    two.save_pretrained(root / "reward2")
    assert "id2label" not in json.loads((root / "reward2/config.json").read_text())
    # Only PyTorch pickles.
    nobin = _patched(actor, root / "pytorch_only")
    for f in [*nobin.glob("*.safetensors"), nobin / "model.safetensors.index.json"]:
        f.unlink()
    (nobin / "pytorch_model.bin").write_bytes(b"not read")
    # A shard the index lists is gone.
    (_patched(actor, root / "lost_shard") / "model-00007-of-00018.safetensors").unlink()
    # One tensor of the wrong shape (the file's header is what show reads).
    bad = _patched(reward, root / "bad_shape")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-8]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _patched(actor, root / "gptq", quantization_config={"quant_method": "gptq", "bits": 4})
    _patched(actor, root / "short", max_position_embeddings=16)
    eos = _patched(actor, root / "eos_oob")
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 600], "bos_token_id": 1}))


def _write(assets, **over) -> Path:
    root = assets["root"]
    fields = {"DATASET": root / "prompts.jsonl", "TOKENIZER": assets["tok"], "ACTOR": assets["actor"],
              "REWARD": assets["reward"], "DATA": ""}
    fields.update(over)
    f = root / f"exp_{abs(hash(tuple(sorted(map(str, fields.items()))))) % 10**8}.py"
    f.write_text(EXPERIMENT.format(**{k: str(v) for k, v in fields.items()}))
    return f


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(cwd)}
    return subprocess.run([sys.executable, "-m", "realloc.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


CASES = {
    "tokenizer directory missing": (dict(TOKENIZER="/nonexistent/tok"), ["tokenizer", "/nonexistent/tok"]),
    "tokenizer files missing": (dict(TOKENIZER="{root}/notok"), ["notok"]),
    "prompt column missing": (dict(DATASET="{root}/wrongcol.jsonl"), ["wrongcol.jsonl", "prompt", "question"]),
    "empty dataset": (dict(DATASET="{root}/empty.jsonl"), ["empty.jsonl"]),
    "every prompt too long": (dict(DATASET="{root}/long.jsonl", DATA='overflow="drop"'),
                              ["long.jsonl", "prompt_len"]),
    "token id out of range": (dict(DATASET="{root}/ids.jsonl"), ["ids.jsonl", "999"]),
    "vocabulary mismatch": (dict(ACTOR="{small}"), ["300", "500"]),
    "unsupported architecture": (dict(ACTOR="{qwen3}"), ["qwen3"]),
    "reward with 2 labels": (dict(REWARD="{root}/reward2"), ["reward", "reward2", "num_labels=2"]),
    "no safetensors": (dict(ACTOR="{root}/pytorch_only"), ["pytorch_only", "pytorch_model.bin", "safetensors"]),
    "missing shard": (dict(ACTOR="{root}/lost_shard"), ["lost_shard", "model-00007-of-00018.safetensors",
                                                        "does not exist"]),
    "wrong tensor shape": (dict(REWARD="{root}/bad_shape"), ["bad_shape", "model.layers.1.mlp.up_proj.weight",
                                                             "(344, 128)", "(352, 128)"]),
    "quantized": (dict(ACTOR="{root}/gptq"), ["gptq", "quantization_config"]),
    # prompt_len 16 + gen_len 4 > 16 positions
    "too few positions": (dict(ACTOR="{root}/short"), ["actor", "prompt_len", "gen_len", "20",
                                                      "max_position_embeddings=16"]),
    "EOS outside the vocabulary": (dict(ACTOR="{root}/eos_oob"), ["eos_oob", "600", "eos_token_id"]),
}


SHOW_TOO = {"tokenizer directory missing", "vocabulary mismatch", "unsupported architecture", "reward with 2 labels",
            "no safetensors", "missing shard", "wrong tensor shape", "quantized", "too few positions",
            "EOS outside the vocabulary"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_before_any_worker(assets, case):
    over, words = CASES[case]
    over = {k: v.format(root=assets["root"], small=assets["small"], qwen3=assets["qwen3"]) for k, v in over.items()}
    exp = _write(assets, **over)
    run_dir = assets["root"] / f"run-{abs(hash(case)) % 10**6}"
    commands = [["run", str(exp), "--plan", "/nonexistent-plan.json", "--run-dir", str(run_dir)]]
    if case in SHOW_TOO:
        commands.append(["show", str(exp)])
    for args in commands:
        r = _cli(*args, cwd=assets["root"])
        err = r.stderr.strip()
        assert r.returncode == 2, (args[0], r.stdout, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        for w in words:
            assert w in err, (args[0], w, err)
    assert not (run_dir / "logs").exists()


def test_the_good_experiment_passes_show(assets):
    r = _cli("show", str(_write(assets)), cwd=assets["root"])
    assert r.returncode == 0, r.stderr
    assert "2/2 kept" in r.stdout
    assert "warning:" not in r.stdout  # the tokenizer's EOS ids stop generation


def test_no_eos_anywhere_is_one_warning(assets):
    """A tokenizer and a generating checkpoint that name no EOS: the run is legal (responses run to gen_len),
    and show says so in one line."""
    root = assets["root"] / "noeos"
    tok = root / "tok"
    shutil.copytree(assets["tok"], tok)
    (tok / "generation_config.json").unlink()
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg.pop("eos_token")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    actor = _patched(assets["actor"], root / "actor", eos_token_id=None)
    (actor / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    r = _cli("show", str(_write(assets, TOKENIZER=tok, ACTOR=actor)), cwd=assets["root"])
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no EOS token id" in warnings[0] and str(tok) in warnings[0], r.stdout
    assert str(actor) in warnings[0] and "gen_len=4" in warnings[0]
