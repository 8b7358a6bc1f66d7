"""Checkpoint files: atomic commit, discovery for --resume, exact optimizer round trip, damage."""

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from realloc.runtime.persist import checkpoint as C


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
    final = C.commit(tmp, tmp_path, 0, {"next_iteration": 1}, "{}")
    with pytest.raises(ValueError, match="saved in layout localhost dp2·tp1·pp1"):
        C.load_model_shard(final, "actor", 0, 0, "localhost:0 dp1·tp1·pp1", params, opt)
    with pytest.raises(ValueError, match="no shard"):
        C.load_model_shard(final, "actor", 1, 0, "localhost dp2·tp1·pp1", params, opt)


def test_a_layout_with_the_same_tp_and_pp_resumes_at_another_dp(tmp_path):
    """The shards depend on tp and pp only (the optimizer state is saved whole at any dp, models/zero.py), so a
    plan that moves the trained model to another dp or other devices resumes; another tp or pp is refused."""
    params, opt = make()
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "localhost dp2·tp1·pp1", params, opt, tp_pp=(1, 1))
    final = C.commit(tmp, tmp_path, 0, {"next_iteration": 1}, "{}")
    fresh = {n: torch.nn.Parameter(torch.zeros_like(p)) for n, p in params.items()}
    C.load_model_shard(final, "actor", 0, 0, "localhost:0 dp1·tp1·pp1", fresh, None, tp_pp=(1, 1))
    assert all(torch.equal(fresh[n], p) for n, p in params.items())
    with pytest.raises(ValueError, match="keeps the model's tp and pp"):
        C.load_model_shard(final, "actor", 0, 0, "localhost dp1·tp1·pp2", fresh, None, tp_pp=(1, 2))


def test_a_shard_of_another_shape_is_refused(tmp_path):
    """E.g. a vocabulary saved without the padding rows the engine now holds: one error naming both shapes."""
    params, opt = make()
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    final = C.commit(tmp, tmp_path, 0, {"next_iteration": 1}, "{}")
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
    final = C.commit(tmp, tmp_path, 0, {"next_iteration": 1}, "{}")
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
    # Same size: only the digest can tell. A file this small is checked before launch too.
    with pytest.raises(ValueError, match=f"checkpoint file {shard} is corrupted: its SHA-256"):
        C.check_files(final)
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
    # Unchecked (--skip-checkpoint-checks), loading the truncated shard is one error naming it (issue 30, defect 6).
    params, opt = make()
    with pytest.raises(ValueError, match=f"checkpoint file {shard} cannot be read .*truncated or damaged"):
        C.load_model_shard(final, "actor", 0, 0, "L", params, opt, verify=False)


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



def test_a_resumed_run_drops_the_later_samples_and_eval_rows(tmp_path):
    """samples.jsonl and eval/iter_<N>.rank<r>.jsonl are appended to: the iterations after the checkpoint,
    which the resumed run writes again, go first."""
    from realloc.runtime.records.run_paths import RunPaths
    from realloc.runtime.run_cli import _drop_later_samples

    run = RunPaths(tmp_path)
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"iteration": t, "seq": 0}) + "\n" for t in (1, 2, 3))
                                            + '{"iteration": 4, "se')
    (tmp_path / "eval").mkdir()
    for name in ("iter_00000002.rank0.jsonl", "iter_00000004.rank0.jsonl", "iter_00000004.rank1.jsonl"):
        (tmp_path / "eval" / name).write_text("{}\n")
    _drop_later_samples(run, 2)
    assert [json.loads(x)["iteration"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["iter_00000002.rank0.jsonl"]


REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = str(REPO / "experiments/ppo_tiny.py")


def resume_cli(ckpt, *extra):
    """`realloc run --resume CKPT` as a user runs it: (exit code, stderr lines). Every case here fails before
    a worker starts."""
    import contextlib
    import io

    from realloc.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", EXPERIMENT, "--resume", str(ckpt), "--iterations", "9", *extra])
    return code, err.getvalue().strip().splitlines()


def ppo_tiny_checkpoint(root, done=3):
    """A committed checkpoint of ppo_tiny's graph (its files need not be real for these checks)."""
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph

    digest = build_graph(load_experiment(EXPERIMENT)).digest
    tmp = C.begin(root, done)
    C.save_rng(tmp, 0)
    return C.commit(tmp, root, done, {"next_iteration": done, "graph_digest": digest}, '{"plan": 1}')


DAMAGED_META = {
    "a JSON list": (b"[1, 2]", "holds a JSON list"),
    "no next_iteration": (json.dumps({"format": 1, "files": {}}).encode(), "has no `next_iteration`"),
    "a files entry without bytes": (json.dumps({"format": 1, "next_iteration": 3, "files": {
        "plan.json": {"sha256": "0" * 64}}}).encode(), "files['plan.json'] has no valid `bytes`"),
    "non-UTF-8 bytes": (b'{"format": 1, "\xff\xfe": 3}', "is not UTF-8 text"),
    "truncated JSON": (b'{"format": 1, "next_iter', "is not valid JSON (line 1, column"),
    "empty": (b"", "is empty"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_META))
def test_a_damaged_meta_json_is_one_line_naming_it(tmp_path, case):
    ckpt = ppo_tiny_checkpoint(tmp_path / "run" / "checkpoints")
    data, words = DAMAGED_META[case]
    (ckpt / C.META).write_bytes(data)
    for target in (ckpt, tmp_path / "run"):  # the checkpoint itself, or found in its run directory
        code, err = resume_cli(target)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"realloc run: error: {ckpt / C.META}") and words in err[0], err
        assert "resume from another checkpoint" in err[0]


def test_resume_verifies_the_plans_sha256_before_using_it(tmp_path):
    ckpt = ppo_tiny_checkpoint(tmp_path / "checkpoints")
    (ckpt / "plan.json").write_text('{"plan": 2}')  # same size: only the digest tells
    with pytest.raises(ValueError, match=f"checkpoint file {ckpt / 'plan.json'} is corrupted"):
        C.check_files(ckpt)
    code, err = resume_cli(ckpt)
    assert code == 2 and len(err) == 1 and f"{ckpt / 'plan.json'} is corrupted" in err[0], err
    rng = C.rng_file(ckpt, 0)
    (ckpt / "plan.json").write_text('{"plan": 1}')
    data = bytearray(rng.read_bytes())
    data[-1] ^= 1
    rng.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"checkpoint file {rng} is corrupted"):  # small files: all checked
        C.check_files(ckpt)


def test_the_newest_checkpoint_without_meta_json_is_an_error_not_a_silent_fallback(tmp_path, caplog):
    root = tmp_path / "run" / "checkpoints"
    older = ppo_tiny_checkpoint(root, done=2)
    newest = ppo_tiny_checkpoint(root, done=4)
    (newest / C.META).unlink()
    code, err = resume_cli(tmp_path / "run")
    assert code == 2 and len(err) == 1, err
    assert f"checkpoint {newest} has no meta.json: it is damaged" in err[0] and f"--resume {older}" in err[0]
    code, err = resume_cli(newest)  # named directly
    assert code == 2 and len(err) == 1 and f"{newest / C.META} is missing" in err[0], err
    with caplog.at_level(logging.WARNING, "realloc.checkpoint"):
        assert C.resolve_resume(tmp_path / "run", skip_checks=True) == older
    assert f"checkpoint {newest} has no meta.json (damaged): skipped" in caplog.text
    (older / C.META).unlink()
    with pytest.raises(ValueError, match="no older checkpoint has one either"):
        C.resolve_resume(root)


def test_a_resume_at_another_tp_is_refused_before_any_worker_starts(tmp_path):
    """Issue 30, defect 6: the checkpoint holds the actor at tp 2, the plan trains it at tp 1: one line naming the
    model and both layouts, from the command itself (the workers would refuse the shards only after starting)."""
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from run_helpers import disjoint_plan

    digest = build_graph(load_experiment(EXPERIMENT)).digest
    root = tmp_path / "run" / "checkpoints"
    tmp = C.begin(root, 3)
    C.save_rng(tmp, 0)
    layouts = {"actor": "localhost dp1·tp2·pp1", "critic": "localhost:1 dp1·tp1·pp1"}
    ckpt = C.commit(tmp, root, 3, {"next_iteration": 3, "graph_digest": digest, "layouts": layouts},
                    disjoint_plan().to_json())
    code, err = resume_cli(ckpt)
    assert code == 2 and len(err) == 1, err
    assert "model 'actor' was saved at tp=2, pp=1 (localhost dp1·tp2·pp1), but this plan trains it at tp=1, pp=1" \
        in err[0] and "--resume" in err[0], err
    C.check_resume_layouts(ckpt, layouts, {"actor": (2, 1), "critic": (1, 1)})  # the same tp and pp: accepted
