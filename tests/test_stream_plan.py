"""Streaming without migration as a plan choice (issue 31 item 2; a ``tail`` entry with instances=0,
docs/tail-semantics.md): the field, validation, JSON and the table; its pricing against a hand formula; the search
choosing it for a disaggregated placement and printing it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.estimator.tail_cost import TAIL_GRID, phase1_cost, tail_generation_cost, tail_rows
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.tail import TailMigration
from realloc.lengths import ResponseLengths as R
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.search.tail_reference import TailView
from realloc.strategy import ParallelStrategy as S

# generation on device 0, every inference call on device 1, the train calls on both (FlexRLHF's disaggregation)
DISAGGREGATED = {"actor_gen": ("localhost:0", 1, 1, 1, 1), "ref_inf": ("localhost:1", 1, 1, 1, 1),
                 "rew_inf": ("localhost:1", 1, 1, 1, 1), "critic_inf": ("localhost:1", 1, 1, 1, 1),
                 "actor_train": ("localhost", 2, 1, 1, 1), "critic_train": ("localhost", 2, 1, 1, 1)}


def _long_tail(gen_len: int = 128):
    base = load_experiment("experiments/ppo_tiny.py")
    return dataclasses.replace(base, gen_len=gen_len, response_lengths=R.lognormal(gen_len / 16, gen_len * 0.8))


@pytest.fixture(scope="module")
def graph():
    return build_graph(_long_tail())


def test_stream_entry_validates_round_trips_and_shows(graph, tmp_path):
    p = ExecutionPlan.by_hand(graph, DISAGGREGATED, tail={"actor_gen": (6, 0)})
    validate_plan(p, graph)  # dp 1: a migration needs dp >= 2, streaming does not
    assert p.tail["actor_gen"].streams_only and not TailMigration(rows=6, instances=1).streams_only
    path = tmp_path / "plan.json"
    p.save(path)
    assert ExecutionPlan.load(path) == p
    assert json.loads(path.read_text())["tail"] == {"actor_gen": {"rows": 6, "instances": 0}}
    assert "tail: actor_gen streams its finished rows to the next calls once at most 6 are running" in p.table()


@pytest.mark.parametrize("tail, message", [
    ({"ref_inf": (6, 0)}, "plan field 'tail' entry 'ref_inf': call 'ref_inf' is an inference call; only GENERATE"),
    ({"actor_gen": (32, 0)}, "plan field 'tail' entry 'actor_gen': .* rows=32 must be below that"),
    ({"actor_gen": (6, 1)}, "at most 0 of them .*0: stream only"),
])
def test_bad_stream_entries_are_one_value_error(graph, tail, message):
    with pytest.raises(ValueError, match=message):
        validate_plan(ExecutionPlan.by_hand(graph, DISAGGREGATED, tail=tail), graph)


def test_stream_prices_the_plain_generation_in_two_parts(graph):
    """Phase 1 is a migration's phase 1 (to the split point); the two parts add up to the plain generation and one
    more call overhead (the second request)."""
    model = CostModel(graph, discover=False)
    mesh = next(m for m in model.cluster.device_meshes() if m.size == 1)
    n = model.workload("actor_gen").n_seqs
    for share in TAIL_GRID:
        rows = tail_rows(n, share)
        got = tail_generation_cost(model, "actor_gen", mesh, S(1, 1, 1), 2, rows, 0)
        plain = model.call_cost("actor_gen", mesh, S(1, 1, 1), 2).time
        assert got.phase1 == phase1_cost(model, "actor_gen", mesh, S(1, 1, 1), 2, rows) < plain
        assert got.migration == 0.0
        assert got.total == pytest.approx(plain + model.hw.call_overhead, rel=1e-12)


def test_search_space_streams_to_the_consumers_off_the_generation_mesh(graph):
    """The disaggregated plan with a stream entry: the inference calls split, the generation's tail node holds the
    whole mesh, both simulators agree, and it is priced below the same placement without the entry."""
    space = PlanSpace.build(graph, CostModel(graph, discover=False), max_n_mbs=2)
    names = space.problem.call_names
    plain = ExecutionPlan.by_hand(graph, DISAGGREGATED)
    base = space.indices_of(plain)
    times = {}
    for share in TAIL_GRID:
        rows = tail_rows(32, share)
        idx = space.indices_of(plain.model_copy(update={"tail": {"actor_gen": TailMigration(rows=rows, instances=0)}}))
        assert space.to_plan(idx, "x").tail == {"actor_gen": TailMigration(rows=rows, instances=0)}
        view = TailView(space.problem, idx)
        g = names.index("actor_gen")
        assert view.tail_devices(g) == {0}
        split = {names[c] for c in view.split_of if view.split(c) is not None}
        assert split == {"ref_inf", "rew_inf", "critic_inf"}  # every consumer on device 1 that reads only G's
        got = space.evaluate(idx)
        assert got == reference.evaluate(space.problem, idx)
        times[rows] = got["time"]
    assert min(times.values()) < space.evaluate(base)["time"]


def test_the_mcmc_streams_a_disaggregated_generation_and_prints_it(graph):
    """Restricted to the disaggregated placements, the search turns streaming on (the stream plan is priced below
    the same placement without it), at the grid R_t the simulator prices best; the summary names the consumers."""
    from types import SimpleNamespace

    from realloc.search.engine import run_mcmc
    from realloc.search.tail_report import tail_summary

    def keep(call: str, o) -> bool:
        mesh, dp = DISAGGREGATED[call][0], DISAGGREGATED[call][1]
        return o.mesh.name == mesh and o.strategy.dp == dp and o.strategy.pp == 1
    space = PlanSpace.build(graph, CostModel(graph, discover=False), option_filter=keep, max_n_mbs=1)
    out = run_mcmc(space, max_evals=4000, time_limit=None, n_threads=1)
    plan = space.to_plan(out.indices, "search")
    t = plan.tail["actor_gen"]
    assert t.streams_only
    # the best stream entry by exhaustive pricing over the grid (placements fixed)
    base = ExecutionPlan.by_hand(graph, DISAGGREGATED)
    priced = {r: space.evaluate(space.indices_of(base.model_copy(update={"tail": {"actor_gen": TailMigration(
        rows=r, instances=0)}})))["time"] for r in {tail_rows(32, s) for s in TAIL_GRID}}
    assert priced[t.rows] == min(priced.values()) == plan.estimated_time
    no_tail = space.to_plan(space.indices_of(base), "x")
    report = SimpleNamespace(no_tail=no_tail, space=space, plan=plan, indices=out.indices, graph=graph)
    lines = tail_summary(report)
    assert lines[0].startswith(f"streaming: actor_gen hands its finished rows on once at most {t.rows} of 32 rows")
    assert lines[1] == "  in two parts off the generation's devices: rew_inf, ref_inf, critic_inf"


def test_the_runtime_refuses_a_stream_entry_it_cannot_run(graph):
    from realloc.graph.streaming import check_runtime_tail, split_consumers

    plan = ExecutionPlan.by_hand(graph, DISAGGREGATED, tail={"actor_gen": (6, 0)})
    check_runtime_tail(plan, graph)
    assert split_consumers(plan, graph, "actor_gen") == ["rew_inf", "ref_inf", "critic_inf"]
    check_runtime_tail(plan.model_copy(update={"staleness": 1}), graph)  # runs ahead of training too (test_tail_stale)
    pp2 = dict(DISAGGREGATED, actor_gen=("localhost", 1, 1, 2, 2))
    check_runtime_tail(ExecutionPlan.by_hand(graph, pp2, tail={"actor_gen": (6, 0)}), graph)  # streams at any pp
    with pytest.raises(ValueError, match="plan field 'tail' entry 'actor_gen': .*migrates .* at pp 1 only"):
        check_runtime_tail(ExecutionPlan.by_hand(graph, pp2, tail={"actor_gen": (6, 1)}), graph)
    by_mb = {"actor_gen": TailMigration(rows=6, instances=0, micro_batches=True)}
    with pytest.raises(ValueError, match="plan field 'tail' entry 'actor_gen': micro_batches at pp 2 hands on waves "
                                         "of 2 micro-batches, so n_mbs must be a multiple of 2 and at least 4"):
        check_runtime_tail(ExecutionPlan.by_hand(graph, pp2, tail=by_mb), graph)
    # generation on both devices: no consumer is off its mesh, nothing splits
    both = dict(DISAGGREGATED, actor_gen=("localhost", 2, 1, 1, 1))
    assert split_consumers(ExecutionPlan.by_hand(graph, both, tail={"actor_gen": (6, 0)}), graph, "actor_gen") == []


def test_estimate_plan_prices_a_stream_entry_as_a_stream_or_as_plain(graph):
    """estimate_plan (realloc show --plan, benchmarks) prices a stream entry by the nearest grid R of a stream row,
    and never as a migration: on a mesh that leaves no device free it is the plain call."""
    from realloc.search.timeline import estimate_plan

    space, idx = estimate_plan(graph, ExecutionPlan.by_hand(graph, DISAGGREGATED, tail={"actor_gen": (5, 0)}))
    assert space.to_plan(idx, "x").tail == {"actor_gen": TailMigration(rows=tail_rows(32, 0.2), instances=0)}
    both = dict(DISAGGREGATED, actor_gen=("localhost", 2, 1, 1, 1))
    space, idx = estimate_plan(graph, ExecutionPlan.by_hand(graph, both, tail={"actor_gen": (6, 0)}))
    assert space.to_plan(idx, "x").tail == {}
