"""Audit, round 13: a new user's audit of the seventh round's features (the KV-cache move at a tail migration,
streaming at pp > 1, parallel tool calls, Phi-3 / Gemma / per-layer windows, prepare undo, export sweeping, the
collective busy-wait). Each test of a defect failed before its fix; its docstring says what the user saw."""

from __future__ import annotations

import pytest
from run_helpers import REPO

PPO = str(REPO / "experiments/ppo_tiny.py")  # gen_len 8, batch 32


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_collective_spin_setting_is_one_line_before_any_worker_runs(tmp_path, monkeypatch, capsys, value):
    """`REALLOC_COLLECTIVE_SPIN_MS=abc realloc run ppo_tiny.py` loaded the models, generated and scored, then
    stopped at iteration 1's critic_train with "worker 0 failed in call critic_train (iteration 1): ValueError:
    ..." and a worker log to read. The setting is read before any worker starts now (preflight), and no run
    directory is left."""
    from realloc.cli import main

    monkeypatch.setenv("REALLOC_COLLECTIVE_SPIN_MS", value)
    run = tmp_path / "run"
    assert main(["run", PPO, "--baseline", "colocate-dp", "--iterations", "1", "--run-dir", str(run)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "REALLOC_COLLECTIVE_SPIN_MS" in err and "worker" not in err, err
    assert not run.exists()


def test_a_bad_collective_spin_setting_stops_realloc_profile_in_one_line(tmp_path, monkeypatch, capsys):
    """`REALLOC_COLLECTIVE_SPIN_MS=abc realloc profile --model tiny --tp 2` started its workers and stopped with
    "realloc profile: internal error: RuntimeError: profiling worker 1 failed: ValueError: ...": the user's
    setting read as realloc's bug. It is read before the workers start now."""
    from realloc.cli import main

    monkeypatch.setenv("REALLOC_COLLECTIVE_SPIN_MS", "abc")
    assert main(["profile", "--model", "tiny", "--tp", "2", "--out", str(tmp_path / "p"), "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "REALLOC_COLLECTIVE_SPIN_MS" in err and "internal" not in err, err


def test_calls_past_max_calls_are_answered_under_their_own_ids(hf_assets, tmp_path):
    """A Mistral-format turn of 10 calls with `max_calls=2` (each with its id, as Mistral's models write them): the
    calls past max_calls were answered `{"content": "error: at most 2 tool calls ...", "call_id": "call00003"}`,
    an id the policy never wrote, so the conversation paired the refusals with no call of its turn. Each refusal
    carries its call's own id now, as the calls that run do."""
    import json
    import re

    from chat_templates import tokenizer_folder

    from realloc.envs.tool_env import ToolEnv

    folder = str(tokenizer_folder(hf_assets.tokenizer, tmp_path / "mistral", "mistral"))
    env = ToolEnv(tools=["calculator"], call_format="chat", chat_template=folder, max_calls=2,
                  limits={"wall_s": 20.0})
    env.reset({"answer": "1"})
    ids = [f"a{i:08d}" for i in range(10)]
    turn = json.dumps([{"name": "calculator", "arguments": {"expression": f"{i}+1"}, "id": c}
                       for i, c in enumerate(ids)])
    obs, _, _ = env.step(turn)
    answers = [json.loads(a) for a in re.findall(r"\[TOOL_RESULTS\] (.*?)\[/TOOL_RESULTS\]", obs)]
    assert [a["call_id"] for a in answers] == ids
    assert [a["content"] for a in answers[:2]] == ["1", "2"] and all("at most 2" in a["content"] for a in answers[2:])
    assert (env.tool_counts["ok"], env.tool_counts["error"]) == (2, 8)


def test_a_hand_plans_kv_choice_is_priced_as_the_runtime_carries_it_out():
    """A hand-written `"tail": {"actor_gen": {"rows": R, "instances": 1, "kv": "move"}}` (or a plan of before, without
    `kv`: the runtime moves the caches) was priced at the cheaper of the move and the re-run prefill, whichever the
    plan said, and `realloc search --plan`'s line read "(prefill re-run)" for a plan whose run moves the caches. The
    estimate of a hand plan now prices its migration as the runtime carries it out: "auto" and "move" as moved
    caches, "prefill" as a re-run prefill (tail_cost.tail_phase_cost with that choice, by hand below)."""
    import dataclasses

    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.estimator.profile_table import ProfileTable
    from realloc.estimator.tail_cost import tail_phase_cost
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from realloc.graph.tail import TailMigration
    from realloc.lengths import ResponseLengths
    from realloc.search.timeline import estimate_plan
    from realloc.strategy import ParallelStrategy

    spec = dataclasses.replace(load_experiment(PPO), gen_len=128, response_lengths=ResponseLengths.lognormal(8, 102))
    graph = build_graph(spec)
    cost = CostModel(graph, profile=ProfileTable.load(str(REPO / "profiles/cpu/tiny.json")), discover=False)
    both = {c: ("localhost", 2, 1, 1, 1) for c in graph.spec.call_names}
    mesh = next(m for m in cost.cluster.device_meshes() if m.size == 2)
    rows = 13  # on the search's grid (tail_cost.TAIL_GRID) for 128 rows
    by_hand = {kv: sum(tail_phase_cost(cost, "actor_gen", mesh, ParallelStrategy(2, 1, 1), rows, 1, kv)[:2])
               for kv in ("move", "prefill")}
    assert by_hand["move"] != by_hand["prefill"]
    for kv, priced in (("auto", "move"), ("move", "move"), ("prefill", "prefill")):
        plan = ExecutionPlan.by_hand(graph, both, source="hand",
                                     tail={"actor_gen": TailMigration(rows=rows, instances=1, kv=kv)})
        space, idx = estimate_plan(graph, plan, cost)
        c = space.problem.call_names.index("actor_gen")
        got = space.tails[c][int(idx[c])]
        assert got.migration.rows == rows and got.migration.moves_kv == (priced == "move"), (kv, got.migration)
        assert got.tail == pytest.approx(by_hand[priced], rel=1e-12), kv


@pytest.mark.parametrize("fused, parts", [("qkv_proj", "q_proj k_proj v_proj"), ("gate_up_proj", "gate_proj up_proj")])
def test_loras_target_of_a_phi3_fused_projection_names_its_parts(fused, parts):
    """A Phi-3 user's LoRA with PEFT's Phi-3 targets (`target_modules=["qkv_proj", "gate_up_proj", ...]`) read
    "unknown module 'qkv_proj'; the LLaMA block's linears are ...", with no word that realloc holds the fused
    projection as its parts, nor that each part gets its own adapter (PEFT's one adapter over the fused rows is
    another model, so the name is not read as an alias)."""
    from realloc.models.lora_config import LoRAConfig

    with pytest.raises(ValueError) as e:
        LoRAConfig(target_modules=(fused, "o_proj"))
    assert f"unknown module {fused!r}" in str(e.value) and f"held as {parts}" in str(e.value)
    assert "own adapter" in str(e.value) and "\n" not in str(e.value)


def test_a_frozen_lora_base_saved_in_bf16_resumes_on_an_fp16_pool_as_the_straight_fp16_run():
    """A LoRA model trained at home on a bf16 pool (an A100's) and resumed with its home on an fp16 pool (a V100's,
    docs/heterogeneous.md): its frozen base has no fp32 master, and bf16 and fp16 are both 16 bits wide, so the
    resume copied the saved bf16 values into fp16, the bf16 rounding of the source, where the straight fp16 run holds
    the source rounded to fp16 (frozen_base.py kept the source only for a narrower saved dtype). Reference: the
    source itself, rounded once to each dtype."""
    import torch

    from realloc.runtime.persist.frozen_base import resumed_value

    source = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    live, saved = source.to(torch.float16), source.to(torch.bfloat16)  # the fp16 pool's model; the bf16 checkpoint
    assert not torch.equal(saved.to(torch.float16), live)  # the copy of before differs from the straight run
    param = torch.empty_like(live)
    param.copy_(resumed_value(live, saved))
    assert torch.equal(param, live)
    changed = saved.clone()
    changed[0, 0] += 1  # a source changed since the checkpoint: the checkpoint's run goes on, as before
    assert torch.equal(resumed_value(live, changed), changed)
    wide = source.to(torch.float32)  # a wider saved dtype is still copied, and rounds as the straight run's source
    assert resumed_value(source.to(torch.bfloat16), wide) is wide


def test_calls_answered_without_running_do_not_hide_a_streak_of_sandbox_failures(hf_assets, tmp_path):
    """With parallel calls, a policy on a machine whose disk is full wrote each turn one good call (the sandbox could
    not start it: `infra`) and one malformed call beside it. The malformed call, answered without running, counted as
    a call that started and reset the streak every turn, so the run trained on error observations for ever instead of
    stopping in one line (docs/multi-turn.md: "any call that started resets the count")."""
    import types

    from chat_templates import tokenizer_folder

    from realloc.envs.tool_env import ToolEnv
    from realloc.envs.tool_health import INFRA_STREAK, InfraWatch

    folder = str(tokenizer_folder(hf_assets.tokenizer, tmp_path / "qwen3", "qwen3"))
    env = ToolEnv(tools=["calculator"], call_format="chat", chat_template=folder)
    env.reset({"answer": "1"})
    full = "error: the tool could not be started: OSError: [Errno 28] No space left on device"
    env.sandbox = types.SimpleNamespace(run=lambda *a, **k: types.SimpleNamespace(status="infra", text=full))
    turn = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>\n{x}\n</tool_call>')
    watch = InfraWatch()
    with pytest.raises(RuntimeError, match=f"the last {INFRA_STREAK} tool calls could not be started"):
        for _ in range(INFRA_STREAK):
            before = watch.counts([env])
            env.step(turn)
            watch.turn("call 'gen'", [env], before)
    assert env.tool_counts["error"] == INFRA_STREAK and env.tool_counts["infra"] == INFRA_STREAK
