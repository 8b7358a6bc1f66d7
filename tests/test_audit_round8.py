"""Audit, round 8: a new user's audit of the features merged in the session of round 7 (token balance by row lists,
checkpoints set aside, resume across dtypes, the dataset digest, plan fields, the planner's options). Each test of a
defect failed before its fix; its docstring says what the user saw."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from run_helpers import REPO

SFT = str(REPO / "experiments/sft_tiny.py")


def test_a_fresh_run_in_a_used_run_directory_sets_the_earlier_runs_checkpoints_and_exports_aside(tmp_path):
    """`realloc run sft_tiny --run-dir RUN --save-every 1 --export-every 1` to iteration 5, then a fresh run (no
    --resume) in the same RUN to iteration 2: its metrics replaced the first run's, but the first run's
    checkpoints 3..5 stayed beside its own 1 and 2, so `realloc export RUN` exported iteration 5 of the replaced
    run and `--resume RUN` would have continued it, silently; and the run itself failed after training with
    'export directory RUN/exports/iter_00000001/actor is not empty; choose a new --out' (an option run does not
    have). A resumed run set them aside already; a fresh one does now too."""
    from realloc.runtime.persist import checkpoint as C
    from realloc.runtime.persist.export import find_checkpoint

    run = tmp_path / "run"
    root = run / "checkpoints"
    for t in range(1, 6):  # the earlier run's history (its contents are never read)
        C.commit(C.begin(root, t), root, t, {"next_iteration": t + 1}, "{}")
        (run / "exports" / C.checkpoint_name(t) / "actor").mkdir(parents=True)
        (run / "exports" / C.checkpoint_name(t) / "actor" / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "realloc.cli", "run", SFT, "--run-dir", str(run), "--quiet", "--iterations", "2",
           "--save-every", "1", "--export-every", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    (aside,) = root.glob("replaced-*")
    assert (f"checkpoints of an earlier run in this run directory (iter_00000001, iter_00000002, iter_00000003, "
            f"iter_00000004, iter_00000005) hold the history this run replaces: moved to {aside}") in r.stdout
    assert sorted(p.name for p in aside.iterdir()) == [C.checkpoint_name(t) for t in range(1, 6)]
    assert sorted(p.name for p in root.glob("iter_*")) == [C.checkpoint_name(1), C.checkpoint_name(2)]
    assert C.resolve_resume(run).name == find_checkpoint(run, None).name == C.checkpoint_name(2)
    assert sorted(p.name for p in (run / "exports").glob("iter_*")) == [C.checkpoint_name(1), C.checkpoint_name(2)]
    assert list((run / "exports" / C.checkpoint_name(2) / "actor").glob("*.safetensors"))  # this run's own export
    (exports_aside,) = (run / "exports").glob("replaced-*")
    assert len(list(exports_aside.glob("iter_*"))) == 5


@pytest.mark.parametrize("base,cls,warned", [("remax_tiny", "TinyReMax", True), ("sft_tiny", "TinySFT", True),
                                             ("rloo_tiny", "TinyRLOO", False)])
def test_balance_tokens_that_cannot_take_effect_is_said_by_show(tmp_path, capsys, monkeypatch, base, cls, warned):
    """`balance_tokens = True` on ReMax (a sampled and a greedy generation call) or on SFT (none) balanced nothing:
    the master deals row lists by the tokens of the graph's one generation call, and otherwise every call keeps the
    even split, while show, run and docs/long-tail.md said nothing of it."""
    from realloc import cli

    exp = tmp_path / "balanced.py"
    (tmp_path / "data").symlink_to(REPO / "experiments/data")  # the experiments' relative paths
    exp.write_text(f"import dataclasses\nfrom {base} import {cls}\n\n\n@dataclasses.dataclass\n"
                   f"class Balanced({cls}):\n    balance_tokens: bool = True\n")
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    assert cli.main(["show", str(exp)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "balance_tokens has" in x]
    if not warned:
        assert lines == []
        return
    assert len(lines) == 1 and lines[0].startswith("warning: balance_tokens has no effect here: "), lines
    assert ("this graph has 2 generation calls (actor_gen, actor_greedy);" if base == "remax_tiny" else
            "this graph has no generation call;") in lines[0], lines


def test_an_fp32_export_of_a_lora_model_trained_in_bf16_merges_its_adapters_master_weights(tmp_path):
    """`realloc export --dtype float32` of a LoRA model trained in bf16 (merged, the default --format hf) read the
    adapters in the checkpoint's bf16 and merged their rounding, the fp32 masters beside them unused, though the
    code said it reads in fp32 (round 7 fixed it for models without LoRA); --format peft and the default dtype were
    right and are unchanged."""
    import dataclasses
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from test_export import CFG, _fake_checkpoint

    from realloc.models.lora_config import LoRAConfig, is_adapter
    from realloc.runtime.persist import checkpoint as C
    from realloc.runtime.persist import lora_export
    from realloc.runtime.persist.export import export_checkpoint

    cfg = dataclasses.replace(CFG, lora=LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "down_proj")))
    ckpt, full = _fake_checkpoint(tmp_path / "run", cfg, 1, 1, iteration=1)
    path = C.shard_file(ckpt, "actor", 0, 0)
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    masters = {k[6:]: torch.randn(v.shape, generator=g) for k, v in tensors.items()
               if k.startswith("param/") and is_adapter(k[6:])}
    assert masters and all(not torch.equal(m.bfloat16().float(), m) for m in masters.values())
    tensors.update({f"master/{n}": m for n, m in masters.items()})  # a bf16 model's shard: only adapters train
    tensors.update({k: v.bfloat16() for k, v in tensors.items() if k.startswith("param/")})
    tensors.update({f"param/{n}": m.bfloat16() for n, m in masters.items()})
    save_file(tensors, str(path))
    meta = json.loads((ckpt / C.META).read_text())
    meta["files"] = {f.relative_to(ckpt).as_posix(): {"sha256": C.sha256_of(f), "bytes": f.stat().st_size}
                     for f in ckpt.rglob("*.safetensors")}
    (ckpt / C.META).write_text(json.dumps(meta))

    def read(out):
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}

    base = {n: t.bfloat16().float() for n, t in full.items() if not is_adapter(n)}  # what the checkpoint holds
    want = lora_export.merge(cfg, {**base, **masters})  # the reference: merged from the masters, in fp32
    wide = read(export_checkpoint(ckpt, "actor", tmp_path / "fp32", dtype="float32"))
    rounded = lora_export.merge(cfg, {**base, **{n: m.bfloat16().float() for n, m in masters.items()}})
    assert not torch.equal(rounded["model.layers.0.self_attn.q_proj.weight"],
                           want["model.layers.0.self_attn.q_proj.weight"])  # what was written
    assert wide.keys() == want.keys()
    for n, t in want.items():
        assert wide[n].dtype == torch.float32 and torch.equal(wide[n], t), n
    own = read(export_checkpoint(ckpt, "actor", tmp_path / "own"))  # the default: the checkpoint's bf16, as before
    bf16 = lora_export.merge(cfg, {**{n: t.bfloat16() for n, t in base.items()},
                                   **{n: m.bfloat16() for n, m in masters.items()}})
    for n, t in bf16.items():
        assert own[n].dtype == torch.bfloat16 and torch.equal(own[n], t), n
    peft = load_file(export_checkpoint(ckpt, "actor", tmp_path / "peft", dtype="float32", fmt="peft")
                     / lora_export.PEFT_WEIGHTS_FILE)
    assert all(torch.equal(peft[lora_export.PEFT_PREFIX + n], m) for n, m in masters.items())


@pytest.mark.parametrize("limits", [{"max_n_mbs": 0}, {"max_n_mbs": -1}, {"max_n_mbs": True}, {"max_n_mbs": 1.5},
                                    {"offload": "no"}])
def test_plan_search_refuses_a_space_limit_it_cannot_mean_in_one_line(limits):
    """`plan_search(max_n_mbs=0)` searched the unlimited space while its baselines were all filtered out as over the
    limit; -1 ended in `ValueError: min() arg is an empty sequence`; True and 1.5 read as 1; `offload="no"` as
    True."""
    from realloc.search.planner import plan_search

    with pytest.raises(ValueError) as e:
        plan_search(str(REPO / "experiments/ppo_tiny.py"), None, max_evals=100, **limits)
    (key, value), = limits.items()
    assert str(e.value).startswith(f"plan_search: {key} must be ") and f"got {value!r}" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("where,value", [("recompute", 1), ("recompute", "yes"), ("offload", 1),
                                         ("micro_batches", 1), ("micro_batches", "on")])
def test_a_plan_files_switches_refuse_what_is_not_true_or_false_by_name(tmp_path, where, value):
    """The counts of a plan refuse true/false (round 7); its switches took a count or a word: `"recompute": 1` or
    `"yes"`, an offload of `1` and a tail's `"micro_batches": 1` all read as true, silently."""
    import json

    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan

    graph = build_graph(load_experiment(str(REPO / "experiments/ppo_tiny.py")))
    plan = ExecutionPlan.by_hand(graph, {c: ("localhost:0", 1, 1, 1, 1) for c in graph.spec.call_names},
                                 recompute=["actor_train"], offload={"ref": True}, tail={"actor_gen": (8, 0)})
    body = json.loads(plan.to_json())
    if where == "recompute":
        body["placements"]["actor_train"]["recompute"], field = value, "placements.actor_train.recompute"
    elif where == "offload":
        body["offload"]["ref"], field = value, "offload"
    else:
        body["tail"]["actor_gen"]["micro_batches"], field = value, "tail.actor_gen.micro_batches"
    (tmp_path / "plan.json").write_text(json.dumps(body))
    with pytest.raises(ValueError) as e:
        ExecutionPlan.load(tmp_path / "plan.json")
    msg = str(e.value)
    assert f"field {field!r}" in msg and f"true or false, got {value!r}" in msg and "\n" not in msg, msg
    assert ExecutionPlan.from_json(plan.to_json()) == plan  # true and false load as before
