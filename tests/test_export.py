"""`realloc export`: a (tp, pp) run checkpoint merged into a HF directory that transformers loads.

The checkpoint is written here by hand from known full tensors, cut with the same
``ParamSpec.shard_slices`` the workers use, so the merge is checked against the tensors
themselves (bit for bit), independently of the runtime. The end-to-end path (a real tp=2, pp=2 run
exported and compared with transformers) is in test_runtime_hf_e2e.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from realloc.models.config import ModelConfig
from realloc.models.param_layout import param_specs, stage_param_specs
from realloc.models.weights import full_state_dict
from realloc.runtime.persist import checkpoint
from realloc.runtime.persist.export import export_checkpoint, find_checkpoint, model_record
from realloc.strategy import ParallelStrategy

REPO = Path(__file__).resolve().parents[1]
CFG = ModelConfig("t", vocab_size=96, hidden_size=64, intermediate_size=128, n_layers=3, n_heads=4, n_kv_heads=2,
                  max_position_embeddings=64, norm_eps=1e-6)


def _fake_checkpoint(root: Path, cfg: ModelConfig, tp: int, pp: int, iteration: int, seed: int = 0,
                     ids: dict | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    full = full_state_dict(cfg, seed)
    ckpt = root / "checkpoints" / checkpoint.checkpoint_name(iteration)
    for stage in range(pp):
        for r in range(tp):
            tensors = {f"param/{s.name}": full[s.name][s.shard_slices(tp, r)].contiguous()
                       for s in stage_param_specs(cfg, pp, stage)}
            tensors["optim/model.norm.weight/exp_avg"] = torch.zeros(1)  # optimizer state is not exported
            path = checkpoint.shard_file(ckpt, "actor", r, stage)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path))
    files = {f.relative_to(ckpt).as_posix(): {"sha256": checkpoint.sha256_of(f), "bytes": f.stat().st_size}
             for f in ckpt.rglob("*.safetensors")}
    rec = model_record(cfg, ParallelStrategy(1, tp, pp), None, None,
                       ids or {"bos_token_id": 1, "eos_token_id": [2, 5], "pad_token_id": 0})
    meta = {"format": checkpoint.CHECKPOINT_FORMAT, "iteration": iteration, "next_iteration": iteration + 1,
            "experiment": "T", "models": {"actor": rec}, "files": files}
    (ckpt / checkpoint.META).write_text(json.dumps(meta))
    return ckpt, full


@pytest.mark.parametrize("tp, pp, tie, critic, vocab", [
    (2, 2, False, False, 96), (1, 3, True, False, 96), (2, 1, False, True, 96),
    # 97 tokens in 100 rows (issue 11): the export drops the zero padding rows, tied, untied and critic
    (4, 1, False, False, 97), (2, 2, True, False, 97), (4, 1, False, True, 97),
])
def test_export_merges_shards_exactly_and_loads_in_transformers(tmp_path, tp, pp, tie, critic, vocab):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    base = ModelConfig(**{**CFG.__dict__, "vocab_size": vocab})
    cfg = base.as_critic() if critic else ModelConfig(**{**base.__dict__, "tie_embeddings": tie})
    assert cfg.padded_vocab_size == (96 if vocab == 96 else 100)
    ckpt, full = _fake_checkpoint(tmp_path / "run", cfg, tp, pp, iteration=4)
    out = export_checkpoint(ckpt, "actor", tmp_path / "hf", max_file_bytes=40_000)  # several files
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    cls = AutoModelForSequenceClassification if critic else AutoModelForCausalLM
    hf = cls.from_pretrained(out)
    state = hf.state_dict()
    assert hf.config.vocab_size == vocab and state["model.embed_tokens.weight"].shape == (vocab, 64)
    for s in param_specs(cfg):
        assert torch.equal(state[s.name], s.unpad(full[s.name])), s.name
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, [2, 5], 0)
    assert hf.config.pad_token_id == 0
    with torch.no_grad():  # it runs
        hf(input_ids=torch.tensor([[3, 4, 5]]))


def test_export_refuses_what_it_cannot_do(tmp_path):
    ckpt, _ = _fake_checkpoint(tmp_path / "run", CFG, 2, 1, iteration=0)
    with pytest.raises(ValueError, match="no trained model 'ref'.*frozen"):
        export_checkpoint(ckpt, "ref", tmp_path / "a")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_checkpoint(ckpt, "actor", tmp_path / "busy")
    shard = checkpoint.shard_file(ckpt, "actor", 1, 0)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte inside a tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tp1_pp0.safetensors is corrupted"):
        export_checkpoint(ckpt, "actor", tmp_path / "b")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b*"))
    export_checkpoint(ckpt, "actor", tmp_path / "b", verify=False)  # the user's explicit choice
    shard.unlink()
    with pytest.raises(ValueError, match="tp1_pp0"):
        export_checkpoint(ckpt, "actor", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_cli_picks_the_checkpoint_by_completed_iterations(tmp_path):
    run = tmp_path / "run"
    _fake_checkpoint(run, CFG, 1, 1, iteration=1, seed=1)
    _, full = _fake_checkpoint(run, CFG, 1, 1, iteration=3, seed=3)
    assert find_checkpoint(run, None).name == checkpoint.checkpoint_name(3)
    assert find_checkpoint(run, 2).name == checkpoint.checkpoint_name(1)
    with pytest.raises(ValueError, match=r"after iterations \[2, 4\]"):
        find_checkpoint(run, 3)
    cmd = [sys.executable, "-m", "realloc.cli", "export", str(run), "--model", "actor", "--out", str(tmp_path / "o"),
           "--iteration", "4", "--dtype", "bfloat16"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert got["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], full["lm_head.weight"].bfloat16())
    bad = subprocess.run(cmd[:-4] + ["--out", str(tmp_path / "p"), "--iteration", "7"], capture_output=True,
                         text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "no checkpoint after iteration 7" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_exported_files_all_get_the_umasks_mode(tmp_path):
    """Issue 22 item 19: safetensors creates its files 0600; an export's weights get the same mode as its config
    (0666 minus the umask), here under umask 027 so that neither the old 0600 nor a fixed 0644 passes."""
    run = tmp_path / "run"
    _fake_checkpoint(run, CFG, 1, 1, iteration=1, seed=1)
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "realloc.cli", "export", str(run), "--model", "actor", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                       preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 0, r.stderr
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert set(modes.values()) == {0o640}, modes


def test_a_failed_export_removes_the_folders_it_created(tmp_path):
    ckpt, _ = _fake_checkpoint(tmp_path / "run", CFG, 2, 1, iteration=0)
    shard = checkpoint.shard_file(ckpt, "actor", 1, 0)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted"):
        export_checkpoint(ckpt, "actor", tmp_path / "new" / "deeper" / "hf")
    assert not (tmp_path / "new").exists()
