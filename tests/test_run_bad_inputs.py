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
from realloc.algorithms.ppo_config import PPOConfig, ppo_rpcs
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
    from realloc.tools.tiny_hf import make_tiny_checkpoint

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
    return {"root": root, "tok": hf_assets.tokenizer, "actor": hf_assets.checkpoint("llama"),
            "reward": hf_assets.checkpoint("llama_reward"), "small": small, "qwen3": qwen3}


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
}


SHOW_TOO = {"tokenizer directory missing", "vocabulary mismatch", "unsupported architecture"}


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
