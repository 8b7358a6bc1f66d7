"""Long-tail migration in the estimator and the search (issue 31 item 3): the phases against a step-by-step
pricing, the consumers' parts against the rows they run, the search choosing a migration and showing the best
plan without one, and fixed lengths searching exactly as before."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from realloc.api import load_experiment
from realloc.cli import main
from realloc.estimator.cost import CostModel
from realloc.estimator.opcount import Phase
from realloc.estimator.tail_cost import TAIL_GRID, consumer_parts, split_ends, tail_generation_cost, tail_rows
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import validate_plan
from realloc.lengths import ResponseLengths as R
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.search.planner import plan_search
from realloc.strategy import ParallelStrategy as S
from run_helpers import tuned_profiles


def _long_tail(path: str = "experiments/ppo_tiny.py", gen_len: int = 128):
    base = load_experiment(path)
    return dataclasses.replace(base, gen_len=gen_len, response_lengths=R.lognormal(gen_len / 16, gen_len * 0.8))


def test_phases_of_a_migrating_generation_step_by_step():
    """Phase 1 decodes every replica's rows up to the migration step; phase 2 decodes, from there, the rows of the
    replica holding the longest row; the migration re-runs their prefill or moves their KV caches."""
    spec = _long_tail()
    model = CostModel(build_graph(spec), discover=False)
    mesh = next(m for m in model.cluster.device_meshes() if m.size == 2)
    s, n = S(2, 1, 1), model.workload("actor_gen").n_seqs
    rows = tail_rows(n, 0.2)
    got = tail_generation_cost(model, "actor_gen", mesh, s, 1, rows, 1, "prefill")  # the move: test_kv_move.py
    timer, links = model._timer(model.graph.model_config("actor_gen")), model.links(mesh, s)
    w, h = model.workload("actor_gen"), model.hw.decode_step_overhead
    all_ends = spec.response_lengths.order_statistics(w.gen_len, n)
    cut = all_ends[n - rows - 1]
    assert sum(e > cut for e in all_ends) <= rows < sum(e >= cut for e in all_ends) + 1  # R_t rows left at the cut

    def step(rows_now: int, ctx: int) -> float:
        return sum(st.compute + st.tp_comm + st.pp_comm + h for st in timer._stages(Phase.DECODE, s, links, rows_now, ctx))

    b = w.micro_batch(s.dp, 1)
    mine = [min(e, cut) for e in spec.response_lengths.order_statistics(w.gen_len, b)]
    pre = sum(st.compute + st.tp_comm + st.pp_comm + h for st in timer._stages(Phase.PREFILL, s, links, b, w.prompt_len))
    phase1 = pre + sum(step(sum(e > j for e in mine), w.prompt_len + j) for j in range(1, max(mine)))
    # one reduction of [unfinished rows, done] per step, each while the next step decodes; the last is waited for
    count = model.comm.time("all_reduce", 2, 16, links.dp)
    assert got.phase1 == pytest.approx(phase1 + model.hw.call_overhead + count, rel=1e-9)
    held = all_ends[n - rows:]  # one replica keeps every tail row
    phase2 = sum(step(sum(e > j for e in held), w.prompt_len + j) for j in range(cut + 1, max(held)))
    assert got.phase2 == pytest.approx(phase2, rel=1e-9)
    # the closing reduction, the row counts and prompt width, the all-gather of each replica's n/2 rows (inputs:
    # 8 prompt tokens, length, dataset row; the prompt; 128 tokens and log-probs; id, lengths; 2 flags), the prefill
    row = 8 * 8 + 8 + 8 + 8 * 8 + (8 + 4) * 128 + 3 * 8 + 2
    gather = model.comm.time("all_gather", 2, (n // 2) * row, links.dp)
    prefill = sum(st.compute + st.tp_comm + st.pp_comm + h
                  for st in timer._stages(Phase.PREFILL, s, links, rows, w.prompt_len + cut))
    assert got.migration == pytest.approx(3 * count + gather + prefill, rel=1e-9) and not got.kv_moved
    assert got.tail == got.migration + got.phase2
    # without migration the call runs its longest row on full replicas: phase 1 is cheaper than that
    assert got.phase1 < model.call_cost("actor_gen", mesh, s, 1).time


def test_consumer_parts_run_the_short_rows_then_the_tail_rows():
    spec = _long_tail()
    model = CostModel(build_graph(spec), discover=False)
    mesh = next(m for m in model.cluster.device_meshes() if m.size == 1)
    n = model.workload("actor_gen").n_seqs
    rows = tail_rows(n, 0.3)
    short, tail = split_ends(spec.response_lengths, spec.gen_len, n, rows)
    assert len(short) == n - rows and len(tail) == rows and max(short) <= min(tail)
    p1, p2 = consumer_parts(model, "ref_inf", "actor_gen", mesh, S(1, 1, 1), 1, rows)
    whole = model.call_cost("ref_inf", mesh, S(1, 1, 1), 1).time
    assert 0 < p1 and 0 < p2 and p2 < whole  # the tail's few rows cost less than the whole batch
    with pytest.raises(ValueError, match="train call"):
        consumer_parts(model, "actor_train", "actor_gen", mesh, S(1, 1, 1), 1, rows)


def test_search_migrates_the_tail_and_keeps_the_plan_without_beside_it(tmp_path, monkeypatch):
    # on the frozen tables: with the shipped ones' KV-cache allocation (engine.kv_alloc) the tail plan still wins
    # by estimate, but 20 000 evaluations at seed 0 stop short of it (seed 1 finds it)
    tuned_profiles(tmp_path / "profiles", monkeypatch)
    rep = plan_search(_long_tail(), None, max_evals=20_000, n_threads=1)
    assert rep.no_tail is not None and not rep.no_tail.tail
    t = rep.plan.tail["actor_gen"]
    # migrating to one replica or streaming (0): here they are within 0.2% of each other, and in-place
    # reallocations (tests/test_realloc_in_place.py) tipped the choice to streaming
    assert t.instances in (0, 1) and t.rows in {tail_rows(32, x) for x in TAIL_GRID}
    assert rep.plan.estimated_time < rep.no_tail.estimated_time
    validate_plan(rep.plan, rep.graph)
    # the plan's migration maps back to its candidate, and the estimate is the simulators' (both agree)
    idx = rep.space.indices_of(rep.plan)
    assert idx.tolist() == rep.indices.tolist() and rep.space.to_plan(idx, "search").tail == rep.plan.tail
    assert reference.evaluate(rep.space.problem, idx)["time"] == rep.plan.estimated_time
    # the estimate of the call is its phases together
    o = rep.space.options[0][int(idx[0])]
    phases = tail_generation_cost(rep.space.cost, "actor_gen", o.mesh, o.strategy, o.n_mbs, t.rows, t.instances)
    assert rep.plan.call_times["actor_gen"] == pytest.approx(phases.total, rel=1e-12)


def test_search_prints_the_migration_and_the_plan_without(tmp_path, capsys, monkeypatch):
    tuned_profiles(tmp_path / "profiles", monkeypatch)
    src = tmp_path / "tail_tiny.py"
    # a tail long enough that migrating it beats running it out, priced over the planner's window with lookahead
    # (at gen_len 128, p99 102 the search runs every generation to its end)
    text = open("experiments/ppo_tiny.py").read().replace("gen_len=8)", "gen_len=240)", 1)
    src.write_text(text.replace("@auto(", "@auto(response_lengths=__import__('realloc.api').api.ResponseLengths"
                                ".lognormal(median=8, p99=230), ", 1))
    spec = load_experiment(str(src))
    assert not spec.response_lengths.is_fixed
    assert main(["search", str(src), "--evals", "20000", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "long-tail migration: actor_gen moves its last" in out and "best plan without migration:" in out
    assert "in two parts on the freed devices:" in out


@pytest.mark.parametrize("path", ["experiments/ppo_tiny.py", "experiments/ppo_7b_7b.py"])
def test_fixed_lengths_search_exactly_as_before(path):
    """Fixed lengths: no migrating candidate, the same problem as with migration off, and the same plan."""
    graph = build_graph(load_experiment(path))
    cost = CostModel(graph)
    a = PlanSpace.build(graph, cost, max_n_mbs=4)
    b = PlanSpace.build(graph, cost, max_n_mbs=4, migrate=False)
    assert a.tails == () and a.problem.tail_columns == () and a.problem.tail_splits == ()
    assert a.options == b.options
    for x, y in zip(a.problem.candidates, b.problem.candidates):
        for f in ("time", "shape_class", "layout", "mem_dynamic"):
            assert getattr(x, f).tolist() == getattr(y, f).tolist()
    plan = np.zeros(a.problem.n_calls, np.int32)
    assert a.evaluate(plan) == b.evaluate(plan)


def test_a_plans_migration_is_what_its_estimate_prices():
    """estimate_plan (realloc show --plan, benchmarks) prices the plan's own migration, not the fastest row: the
    grid R_t itself, or the nearest grid R_t of the same replicas for a hand-written one."""
    from realloc.graph.plan import ExecutionPlan
    from realloc.search.timeline import estimate_plan

    spec = _long_tail()
    graph = build_graph(spec)
    places = {c: ("localhost", 2, 1, 1, 1) for c in spec.call_names}
    priced = {}
    for rows in (None, 3, 4, 13):
        plan = ExecutionPlan.by_hand(graph, places, tail={} if rows is None else {"actor_gen": (rows, 1)})
        space, idx = estimate_plan(graph, plan)
        priced[rows] = space.to_plan(idx, "x").tail.get("actor_gen")
    assert priced[None] is None
    assert priced[3].rows == 3 and priced[4].rows == 3 and priced[13].rows == 13  # 32 rows: the grid holds 3, 13
