"""Multi-turn rollouts planned (issue 34, item 4): the turn profile (declared, default, measured from a run's
records), the estimator's price of a multi-turn GENERATE call against its turns assembled by hand from
``CallTimer.generate`` and the environment's rounds, what ``show``/``search`` print, and the timeline's turns."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto, experiment_spec
from realloc.envs.turn_profile import declared_profile, segments_of, turns_from_run
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.lengths import ResponseLengths
from realloc.strategy import ParallelStrategy

P, T, PROMPTS, SAMPLES = 8, 40, 8, 4  # 32 rollouts


def _spec(env: dict, **kw):
    @auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=PROMPTS, prompt_len=P, gen_len=T, **kw)
    @dataclasses.dataclass
    class MT:
        @property
        def rpcs(self):
            return multiturn_rpcs("grpo", env=env, actor="tiny", n_samples=SAMPLES)

    return experiment_spec(MT)


def _env(**extra) -> dict:
    return {"env": "tools", "max_turns": 3, "turn_tokens": 16, **extra}


def test_a_declared_profile_is_priced_turn_by_turn():
    # step_s measured with 4 tool processes at once, as this plan runs them: no contention priced on top
    # (tests/test_tool_contention.py prices it)
    profile = {"policy_tokens": [12, 6], "observation_tokens": [9], "reach": [1.0, 0.5], "step_s": 0.1,
               "final_s": 0.01, "tool_processes": 4}
    graph = build_graph(_spec(_env(turn_profile=profile, env_workers=4, kv_cache=False)))  # every turn prefills all
    cost = CostModel(graph)
    mesh, s = graph.spec.cluster.device_meshes()[0], ParallelStrategy(1, 1, 1)
    got = cost.call_cost("actor_gen", mesh, s, 2)
    timer = cost._timer(graph.model_config("actor_gen"))
    links = cost.links(mesh, s)
    # by hand: turn 1, all 32 rollouts in 2 micro-batches of 16, 12 tokens each after the prompt; half of them call
    # the tool (0.1 s), the other half end (0.01 s), 4 at a time: 8 rounds of the mean step
    gen1 = timer.generate(s, links, 16, P, 12, 2).time
    env1 = math.ceil(32 / 4) * (0.5 * 0.1 + 0.5 * 0.01)
    # turn 2: the 16 that go on, after 12 policy and 9 observation tokens, 6 tokens each; all end
    gen2 = timer.generate(s, links, 8, P + 12 + 9, 6, 2).time
    env2 = math.ceil(16 / 4) * 0.01
    want = gen1 + env1 + gen2 + env2 + cost.hw.call_overhead
    assert got.time == pytest.approx(want, rel=1e-9)
    assert got.overhead >= env1 + env2
    turns = cost.turns("actor_gen", mesh, s, 2)
    assert [(t.turn, t.rows, t.prompt, t.tokens) for t in turns] == [(1, 32, P, 12), (2, 16, P + 21, 6)]
    assert [t.env_s for t in turns] == pytest.approx([env1, env2])
    # dp 2: each replica runs half the rollouts, its tools at the same time as the other's: 8 tool processes at
    # once on the host's 2 cores, against the profile's 4, so a tool step takes twice as long (tool_slowdown)
    dp2 = cost.turns("actor_gen", graph.spec.cluster.device_meshes()[2], ParallelStrategy(2, 1, 1), 1)
    assert [t.rows for t in dp2] == [16, 8]
    assert dp2[0].env_s == pytest.approx(math.ceil(16 / 4) * (0.5 * 0.1 * 2 + 0.5 * 0.01))


def test_with_the_kv_cache_kept_a_later_turn_prefills_only_what_was_appended():
    profile = {"policy_tokens": [12, 6], "observation_tokens": [9], "reach": [1.0, 0.5], "step_s": 0.1,
               "final_s": 0.01}
    kept = CostModel(build_graph(_spec(_env(turn_profile=profile, env_workers=4))))  # kv_cache: the default
    full = CostModel(build_graph(_spec(_env(turn_profile=profile, env_workers=4, kv_cache=False))))
    meshes = kept.graph.spec.cluster.device_meshes()
    mesh = meshes[0]
    for m, s, n_mbs in ((mesh, ParallelStrategy(1, 1, 1), 2), (meshes[2], ParallelStrategy(1, 1, 2), 4)):  # pp 2
        a, b = kept.turns("actor_gen", m, s, n_mbs), full.turns("actor_gen", m, s, n_mbs)
        assert a[0].generate == b[0].generate  # turn 1 has nothing kept
        assert [(t.rows, t.prompt, t.tokens, t.env_s) for t in a] == [(t.rows, t.prompt, t.tokens, t.env_s) for t in b]
        assert a[1].generate.time < b[1].generate.time
    s = ParallelStrategy(1, 1, 1)
    timer, links = kept._timer(kept.graph.model_config("actor_gen")), kept.links(mesh, s)
    # pp 1, turn 2 (2 micro-batches of 8 rows, prompt P + 12 + 9): the same decode steps; each micro-batch's prefill
    # runs the last sampled token and the 9 observation tokens instead of all P + 21
    assert (full.call_cost("actor_gen", mesh, s, 2).time - kept.call_cost("actor_gen", mesh, s, 2).time
            == pytest.approx(2 * (timer.generate(s, links, 8, P + 21, 1, 1).time
                                  - timer.generate_varied(s, links, 8, P + 21, (1,) * 8, 1, 10).time), rel=1e-9))


def test_without_a_profile_the_most_a_rollout_may_take_within_the_budget():
    graph = build_graph(_spec(_env(kv_cache=False)))  # 3 turns of at most 16 tokens in a budget of 40
    cost = CostModel(graph)
    mesh, s = graph.spec.cluster.device_meshes()[0], ParallelStrategy(1, 1, 1)
    turns = cost.turns("actor_gen", mesh, s, 1)
    assert [(t.prompt, t.tokens) for t in turns] == [(P, 16), (P + 16, 16), (P + 32, 8)]  # the budget cuts turn 3
    timer = cost._timer(graph.model_config("actor_gen"))
    links = cost.links(mesh, s)
    want = sum(timer.generate(s, links, 32, p, g, 1).time for p, g in ((P, 16), (P + 16, 16), (P + 32, 8)))
    assert cost.call_cost("actor_gen", mesh, s, 1).time == pytest.approx(want + cost.hw.call_overhead, rel=1e-9)
    # the other calls keep their single-turn price
    single = build_graph(_spec({"env": "tools", "max_turns": 1}))
    assert cost.call_cost("ref_inf", mesh, s, 1) == CostModel(single).call_cost("ref_inf", mesh, s, 1)


@pytest.mark.parametrize("profile, message", [
    ({"observation_tokens": [3]}, "needs 'policy_tokens'"),
    ({"policy_tokens": [4], "tool_s": 1}, "unknown: 'tool_s'"),
    ({"policy_tokens": [4, 4, 4, 4]}, "has 4 turns but max_turns is 3"),
    ({"policy_tokens": [4, 0]}, "['policy_tokens'] must be a number >= 1"),
    ({"policy_tokens": [4, 4], "reach": [1.0, 1.5]}, "must be shares of the rollouts"),
    ({"policy_tokens": 4}, "must be a list of numbers"),
    ([4], "must be a dict"),
])
def test_a_bad_turn_profile_is_one_error_naming_the_call_and_key(profile, message):
    with pytest.raises(ValueError, match="call 'actor_gen': interface_args\\['turn_profile'\\]") as e:
        build_graph(_spec(_env(turn_profile=profile)))  # show checks interface_args through check_args
    assert message in str(e.value)


def test_segments_are_the_alternating_runs_environment_first():
    assert segments_of([0, 0, 1, 1, 1, 0, 1]) == [2, 3, 1, 1]
    assert segments_of([1, 1, 0]) == [0, 2, 1]
    assert segments_of([]) == [0]


def _fake_run(root: Path) -> Path:
    root.mkdir()
    samples = [[0, 10, 5, 4], [0, 14, 7, 2], [0, 12], [3, 8, 5, 6, 5, 1]]  # turns 10/14/12/8, 4/2/6, 1
    lines = [{"iteration": 1, "seq": i, "logp": [0.0] * sum(s), "turn_segments": s} for i, s in enumerate(samples)]
    (root / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    stats = [{"env_obs_s": 0.6, "env_obs_steps": 3.0, "env_final_s": 0.02, "env_final_steps": 4.0},
             {"env_obs_s": 0.2, "env_obs_steps": 1.0, "env_final_s": 0.0, "env_final_steps": 0.0}]
    (root / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i + 1, "calls": {"actor_gen": s}}) + "\n"
                                                for i, s in enumerate(stats)))
    return root


def test_the_profile_of_an_earlier_run(tmp_path):
    prof = turns_from_run(_fake_run(tmp_path / "run"))
    assert prof.turns == 3
    assert prof.policy[0] == ResponseLengths.empirical([10, 14, 12, 8])
    assert prof.policy[1] == ResponseLengths.empirical([4, 2, 6]) and prof.policy[2] == ResponseLengths.empirical([1])
    assert prof.reach == pytest.approx((1.0, 0.75, 0.25))
    assert prof.observations == pytest.approx(((5 + 7 + 5) / 3, 5.0, 0.0))
    assert prof.first_observation == pytest.approx(3 / 4)
    assert prof.step_s == pytest.approx(0.8 / 4) and prof.final_s == pytest.approx(0.02 / 4)
    assert declared_profile("actor_gen", prof, 3) is prof


def test_search_lengths_from_prices_the_turns_of_an_earlier_run(tmp_path, capsys):
    from realloc.search.turns_report import turns_from

    run = _fake_run(tmp_path / "run")
    spec = turns_from(_spec(_env()), run)
    cost = CostModel(build_graph(spec))
    assert cost.rollout_shape("actor_gen").profile.source.startswith("measured: 4 rollouts")
    mesh, s = spec.cluster.device_meshes()[0], ParallelStrategy(1, 1, 1)
    turns = cost.turns("actor_gen", mesh, s, 1)
    assert [t.rows for t in turns] == [32, 24, 8] and turns[0].tokens == 14  # the longest of 32 first turns
    assert turns[0].env_s == pytest.approx(8 * 0.75 * 0.2 + 8 * 0.25 * 0.005)


def test_show_and_search_print_the_turns(tmp_path, capsys):
    from realloc.cli import main

    exp = tmp_path / "mt.py"
    exp.write_text(f'''
import dataclasses
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto

ENV = {{"env": "tools", "max_turns": 2, "turn_tokens": 16,
       "turn_profile": {{"policy_tokens": [12, 6], "observation_tokens": [9], "step_s": 0.2}}}}

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=40)
@dataclasses.dataclass
class MT:
    dataset: str = "{Path(__file__).resolve().parents[1]}/experiments/data/calc_train.jsonl"
    tokenizer: str = "{Path(__file__).resolve().parents[1]}/experiments/data/calc_tokenizer"

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=4)
''')
    assert main(["show", str(exp)]) == 0
    out = capsys.readouterr().out
    assert "turns      actor_gen: 2 turns of 12.0, 6.0 policy tokens, observations 9.0 tokens, 200 ms per tool " \
           "step (declared)" in out
    timeline = tmp_path / "t.html"
    assert main(["search", str(exp), "--evals", "2000", "--timeline", str(timeline)]) == 0
    out = capsys.readouterr().out
    assert "actor_gen per dp rank: turn 1:" in out and "turn 2:" in out
    assert 'data-kind="tools" data-call="actor_gen turn 1: environment"' in timeline.read_text()


def test_the_estimated_timeline_draws_each_turn_s_environment_inside_the_call():
    from realloc.search.timeline import estimate_plan, estimated_panel

    profile = {"policy_tokens": [12, 6], "observation_tokens": [9], "step_s": 0.5, "tool_processes": 4}
    graph = build_graph(_spec(_env(turn_profile=profile)))
    plan = ExecutionPlan.by_hand(graph, {c: ("localhost:0", 1, 1, 1, 1) for c in graph.topo_order})
    space, indices = estimate_plan(graph, plan)
    panel = estimated_panel(space, indices, plan, iterations=1)
    call = next(b for b in panel.boxes if b.kind == "call" and b.label == "actor_gen")
    tools = [b for b in panel.boxes if b.kind == "tools"]
    assert [b.label for b in tools] == ["actor_gen turn 1: environment"]  # turn 2 ends every rollout: no tools
    t = tools[0]
    assert call.start < t.start < t.end < call.end and (t.lo, t.hi) == (call.lo, call.hi)
    want = math.ceil(32 / 4) * 0.5
    assert (t.end - t.start) / (call.end - call.start) == pytest.approx(
        want / space.cost.call_cost("actor_gen", graph.spec.cluster.device_meshes()[0], ParallelStrategy(1, 1, 1),
                                    1).time, rel=1e-6)


def test_the_measured_timeline_draws_each_turn_s_environment_from_the_run_s_metrics():
    from realloc.search.timeline import Box
    from realloc.search.turns_report import measured_turn_boxes

    graph = build_graph(_spec(_env()))
    plan = ExecutionPlan.by_hand(graph, {c: ("localhost", 2, 1, 1, 1) for c in graph.topo_order})
    boxes = [Box("call", "actor_gen", 0, 1, 10.0, 14.0, 1), Box("call", "actor_gen", 1, 2, 10.0, 13.5, 1),
             Box("call", "ref_inf", 0, 1, 14.0, 14.5, 1)]
    # summed over the 2 replicas: per replica turn 1 is 0.5 s of generation and 2 s of tools, turn 2 0.25 s and 0
    stats = {"turn1_generate_s": 1.0, "turn1_env_s": 4.0, "turn2_generate_s": 0.5, "turn2_env_s": 0.0}
    got = measured_turn_boxes(plan, boxes, [{"iteration": 1, "calls": {"actor_gen": stats}}])
    assert [(b.kind, b.label, b.lo, b.start, b.end) for b in got] == [
        ("tools", "actor_gen turn 1: environment", 0, 10.5, 12.5),
        ("tools", "actor_gen turn 1: environment", 1, 10.5, 12.5)]
    assert measured_turn_boxes(plan, boxes, [{"iteration": 2, "calls": {"actor_gen": stats}}]) == []
