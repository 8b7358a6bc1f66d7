"""Checkpoint files: atomic commit, discovery for --resume, exact optimizer round trip."""

import hashlib
import json

import pytest
import torch

from realloc.runtime import checkpoint as C


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.nn.Parameter(torch.randn(4, 3, generator=g)), "b": torch.nn.Parameter(torch.randn(3, generator=g))}
    opt = torch.optim.AdamW([{"params": [params["w"]], "weight_decay": 0.1},
                             {"params": [params["b"]], "weight_decay": 0.0}], lr=0.05)
    return params, opt


def step(params, opt, k):
    x = torch.arange(4.0) + k
    loss = ((x @ params["w"] + params["b"]) ** 2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_resumed_optimizer_continues_exactly(tmp_path):
    params, opt = make()
    for k in range(3):
        step(params, opt, k)
    tmp = C.begin(tmp_path, 2)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    C.save_rng(tmp, 0)
    final = C.commit(tmp, tmp_path, 2, {"next_iteration": 3}, "{}")
    for k in range(3, 6):
        step(params, opt, k)

    fresh, fresh_opt = make(seed=1)  # different values: everything must come from the file
    torch.manual_seed(123)
    C.load_model_shard(final, "actor", 0, 0, "L", fresh, fresh_opt)
    C.load_rng(final, 0)
    for k in range(3, 6):
        step(fresh, fresh_opt, k)
    for n in params:
        assert torch.equal(params[n], fresh[n])
    assert fresh_opt.param_groups[0]["weight_decay"] == 0.1


def test_uncommitted_checkpoints_are_invisible_and_cleaned(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    tmp = C.begin(root, 0)
    C.save_rng(tmp, 0)
    assert C.latest(root) is None  # killed before commit: nothing to resume from
    with pytest.raises(ValueError, match="no complete checkpoint"):
        C.resolve_resume(run)
    first = C.commit(tmp, root, 0, {"next_iteration": 1}, "{}")
    tmp2 = C.begin(root, 1)  # a later save that never finishes
    assert C.latest(root) == first
    assert C.resolve_resume(run) == first == C.resolve_resume(root) == C.resolve_resume(first)
    assert C.read_meta(first)["next_iteration"] == 1 and (first / "plan.json").read_text() == "{}"
    C.begin(root, 2)
    assert not tmp2.exists()  # stale temporaries are removed by the next save


def test_layout_mismatch_is_refused(tmp_path):
    params, opt = make()
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "localhost dp2·tp1·pp1", params, opt)
    final = C.commit(tmp, tmp_path, 0, {}, "{}")
    with pytest.raises(ValueError, match="saved in layout localhost dp2·tp1·pp1"):
        C.load_model_shard(final, "actor", 0, 0, "localhost:0 dp1·tp1·pp1", params, opt)
    with pytest.raises(ValueError, match="no shard"):
        C.load_model_shard(final, "actor", 1, 0, "localhost dp2·tp1·pp1", params, opt)


def test_a_shard_of_another_shape_is_refused(tmp_path):
    """E.g. a vocabulary saved without the padding rows the engine now holds: one error naming both shapes."""
    params, opt = make()
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    final = C.commit(tmp, tmp_path, 0, {}, "{}")
    bigger = {"w": torch.nn.Parameter(torch.zeros(5, 3)), "b": params["b"]}
    with pytest.raises(ValueError, match=r"parameter 'w' has shape \(4, 3\), this model's shard is \(5, 3\)"):
        C.load_model_shard(final, "actor", 0, 0, "L", bigger, None)


def test_bf16_master_weights_round_trip(tmp_path):
    from realloc.models.optim import MasterWeightAdamW

    def build(seed):
        g = torch.Generator().manual_seed(seed)
        params = {"w": torch.nn.Parameter(torch.randn(4, 3, generator=g).bfloat16())}
        return params, MasterWeightAdamW(params, lr=1e-3)

    def bf16_step(params, opt, k):
        opt.step_with({"w": torch.full((4, 3), 0.1 * (k + 1))})

    params, opt = build(0)
    for k in range(2):
        bf16_step(params, opt, k)
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    final = C.commit(tmp, tmp_path, 0, {}, "{}")
    for k in range(2, 4):
        bf16_step(params, opt, k)
    fresh, fresh_opt = build(1)
    C.load_model_shard(final, "actor", 0, 0, "L", fresh, fresh_opt)
    for k in range(2, 4):
        bf16_step(fresh, fresh_opt, k)
    assert torch.equal(params["w"], fresh["w"]) and torch.equal(opt.masters["w"], fresh_opt.masters["w"])


def saved_checkpoint(tmp_path):
    params, opt = make()
    step(params, opt, 0)
    tmp = C.begin(tmp_path, 1)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    C.save_rng(tmp, 0)
    return C.commit(tmp, tmp_path, 1, {"next_iteration": 1}, "{}"), params, opt


def test_commit_records_each_files_sha256_and_size(tmp_path):
    final, _, _ = saved_checkpoint(tmp_path)
    files = C.read_meta(final)["files"]
    on_disk = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file() and p.name != C.META)
    assert sorted(files) == on_disk == ["models/actor/tp0_pp0.safetensors", "plan.json", "rng/rank0.safetensors"]
    for rel, rec in files.items():
        data = (final / rel).read_bytes()
        assert rec == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    C.check_files(final)


def test_flipped_bytes_in_a_shard_are_one_error_naming_the_file(tmp_path):
    final, _, _ = saved_checkpoint(tmp_path)
    shard = C.shard_file(final, "actor", 0, 0)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes: safetensors itself would not notice
    shard.write_bytes(bytes(data))
    C.check_files(final)  # same size: only the digest can tell
    params, opt = make(seed=1)
    with pytest.raises(ValueError, match=f"checkpoint file {shard} is corrupted: its SHA-256"):
        C.load_model_shard(final, "actor", 0, 0, "L", params, opt)
    C.load_model_shard(final, "actor", 0, 0, "L", params, opt, verify=False)  # the user's explicit choice


def test_a_missing_or_truncated_file_is_one_error_unless_checks_are_skipped(tmp_path, caplog):
    final, _, _ = saved_checkpoint(tmp_path)
    rng = C.rng_file(final, 0)
    rng.unlink()
    with pytest.raises(ValueError, match=f"checkpoint file {rng} is missing"):
        C.check_files(final)
    with pytest.raises(ValueError, match=f"checkpoint file {rng} is missing"):
        C.load_rng(final, 0)
    C.load_rng(final, 0, verify=False)
    assert "rank 0 continues with a fresh RNG state" in caplog.text
    shard = C.shard_file(final, "actor", 0, 0)
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ValueError, match="has .* bytes, but .* were saved"):
        C.check_files(final)


def test_a_checkpoint_without_checksums_needs_the_explicit_flag(tmp_path):
    final, params, opt = saved_checkpoint(tmp_path)
    meta = json.loads((final / C.META).read_text())
    del meta["files"]
    (final / C.META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="records no checksums.*--skip-checkpoint-checks"):
        C.check_files(final)
    with pytest.raises(ValueError, match="records no checksums"):
        C.load_model_shard(final, "actor", 0, 0, "L", params, opt)
    C.load_model_shard(final, "actor", 0, 0, "L", params, opt, verify=False)


def test_a_half_written_last_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    from realloc.runtime.run_cli import _truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "reward": 0.25}\n{"iteration": 2, "reward": 0.5}\n{"iteration": 3, "rew')
    _truncate_metrics(path, 2)
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [1, 2]
    assert f"dropped the half-written last line of {path}" in capsys.readouterr().err
    path.write_text('{"iteration": 1}\n{"iter\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=f"{path}: line 2 is not JSON"):
        _truncate_metrics(path, 2)
