"""Chunked streaming as a plan choice (issue 31 item 2; a stream-only ``tail`` entry with ``chunks=k``,
estimator/chunk_cost.py): the field and its checks, its pricing against hand formulas, both plan simulators on
random problems with chunk arrays and on a schedule computed by hand, the search choosing it and printing it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_simulator import assert_agrees, random_plan, random_problem
from test_stream_plan import DISAGGREGATED, _long_tail
from test_tail_simulator import _one, random_tails

from realloc.estimator.chunk_cost import chunk_work, chunked_generation_cost, lead_shares, split_times
from realloc.estimator.cost import CostModel
from realloc.estimator.tail_cost import consumer_parts, migration_step, phase1_cost
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.tail import TailMigration, split_thresholds
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.search.problem import PairCosts, SearchProblem
from realloc.search.tail_problem import TailColumns, TailSplit
from realloc.search.tail_reference import TailView
from realloc.strategy import ParallelStrategy as S


@pytest.fixture(scope="module")
def graph():
    return build_graph(_long_tail())


def test_a_chunked_entry_validates_round_trips_and_shows(graph, tmp_path):
    p = ExecutionPlan.by_hand(graph, DISAGGREGATED, tail={"actor_gen": (6, 0, 3)})
    validate_plan(p, graph)
    path = tmp_path / "plan.json"
    p.save(path)
    assert ExecutionPlan.load(path) == p
    assert json.loads(path.read_text())["tail"] == {"actor_gen": {"rows": 6, "instances": 0, "chunks": 3}}
    assert "at most 6 are running (no migration), in 3 chunks" in p.table()


@pytest.mark.parametrize("tail, message", [
    ({"actor_gen": TailMigration(rows=6, instances=1, chunks=2)}, "chunks=2, but only a stream-only entry .*chunks=1"),
    ({"actor_gen": (30, 0, 3)}, "chunks=3, more than the 2 rows that finish before the last split point"),
])
def test_bad_chunked_entries_are_one_value_error(graph, tail, message):
    places = dict(DISAGGREGATED, actor_gen=("localhost", 2, 1, 1, 1)) if "instances=1" in repr(tail) else DISAGGREGATED
    with pytest.raises(ValueError, match="plan field 'tail' entry 'actor_gen': call 'actor_gen' has " + message):
        validate_plan(ExecutionPlan.by_hand(graph, places, tail=tail), graph)


def test_chunked_pricing_by_hand(graph):
    """The generation: its plain time split at the last split point plus one request (overhead + dispatch latency)
    per earlier split point and the second part's overhead; the split points at phase 1's times; a consumer's chunk
    work on the expected lengths between the thresholds (one chunk: the plain part 1)."""
    model = CostModel(graph, discover=False)
    mesh = next(m for m in model.cluster.device_meshes() if m.size == 1)
    s, n, rows, k = S(1, 1, 1), 32, 2, 4
    hw = model.hw
    plain = model.call_cost("actor_gen", mesh, s, 1).time
    tc, lead = chunked_generation_cost(model, "actor_gen", mesh, s, 1, rows, k)
    assert tc.total == pytest.approx(plain + (k - 1) * (hw.call_overhead + hw.dispatch_latency) + hw.call_overhead,
                                     rel=1e-12)
    times = split_times(model, "actor_gen", mesh, s, 1, rows, k)
    want = [phase1_cost(model, "actor_gen", mesh, s, 1, th) + j * (hw.call_overhead + hw.dispatch_latency)
            for j, th in enumerate((24, 17, 9, 2))]  # rows + (32 - 2) (4 - j) // 4, by hand
    assert times == pytest.approx(want, rel=1e-12) and lead == pytest.approx(want[-1] - want[0], rel=1e-12)
    steps = [migration_step(model, "actor_gen", th) for th in (24, 17, 9, 2)]
    assert lead_shares(model, "actor_gen", rows, k, 3) == pytest.approx(
        [(steps[-1] - x) / (steps[-1] - steps[0]) / 3 for x in steps[:-1]])
    work = chunk_work(model, "critic_inf", "actor_gen", mesh, s, 1, rows, k)
    one, two = consumer_parts(model, "critic_inf", "actor_gen", mesh, s, 1, rows)
    assert len(work) == k and all(w > 0 for w in work)
    # k chunks cost more than one part on the same rows: their requests, and each call's fixed costs
    assert one + (k - 1) * (hw.dispatch_latency + 2 * hw.call_overhead) < sum(work) and two > 0
    assert chunk_work(model, "critic_inf", "actor_gen", mesh, s, 1, rows, 1) == pytest.approx((one,), rel=1e-12)


def _chunked(rng: np.random.Generator, p: SearchProblem) -> SearchProblem:
    """``p`` (with random tails) with random leads on its tail columns and random chunk arrays on its splits."""
    cols = tuple((c, dataclasses.replace(t, lead=rng.choice([0.0, 0.5, 1.0, 2.0], size=t.grid.size)))
                 for c, t in p.tail_columns)
    splits = []
    for s in p.tail_splits:
        depth = int(rng.integers(1, 4))
        work = rng.choice([0.5, 2.5, 4.0], size=(*s.part1.shape, depth))
        share = rng.choice([0.0, 0.25, 0.5, 1.0], size=(s.part1.shape[1], depth))
        splits.append(dataclasses.replace(s, chunk_work=work, chunk_share=share))
    return dataclasses.replace(p, tail_columns=cols, tail_splits=tuple(splits))


def test_cpp_matches_python_reference_with_chunked_splits():
    rng = np.random.default_rng(3133)
    n_chunked = 0
    for trial in range(300):
        p = _chunked(rng, random_tails(rng, random_problem(rng), stream=0.5))
        cpp = p.to_cpp()
        for _ in range(3):
            plan = random_plan(rng, p)
            assert_agrees(cpp, p, plan, trial)
            view = TailView(p, plan)
            n_chunked += sum(view.split(c) is not None and view.part1(c) > view.split(c)[0].part1[plan[c],
                                                                                                  view.split(c)[2]]
                             for c in view.split_of)
    assert n_chunked > 10, n_chunked  # the chunk arrays decided part 1 often


def test_a_chunked_part_one_by_hand():
    """Generation on device 0 (phase 1 to the last split point: 2 s, then 3 s to its end; its first split point
    1 s before the last); a consumer on device 1 whose chunks cost 1.5 s from the first on and 0.3 s for the last:
    part 1 runs max(0.3, 1.5 - 1 x 1.0) = 0.5 s from the last split point, in both simulators."""
    p = SearchProblem(
        n_devices=2, device_memory=1 << 30, call_names=("gen", "inf"), call_model=(0, 1), model_names=("a", "b"),
        model_home=(0, 1), candidates=(_one(0, 1, 2.0), _one(1, 2, 9.0)), order_edges=(), carry_edges=(),
        data_edges=((0, 1),), data_costs=(PairCosts.dense(np.zeros((1, 1))),),
        realloc_costs=tuple(PairCosts(1, 1) for _ in range(2)), n_iterations=3,
        tail_columns=((0, TailColumns([0], [1], [3.0], [1.0])),),
        tail_splits=(TailSplit(0, [[0.3]], [[0.2]], [0.9], [0.1], np.full((1, 1, 1), 1.5), [[1.0]]),))
    plan = np.zeros(2, np.int32)
    for sched in (reference.schedule(p, plan),
                  [dict(kind=r[0], call=r[1], iteration=r[3], start=r[4], end=r[5]) for r in p.to_cpp().schedule(plan)]):
        first = {(r["kind"], r["call"]): (r["start"], r["end"]) for r in sched if r["iteration"] == 0}
        assert first[0, 0] == (0.0, 2.0) and first[3, 0] == (2.0, 5.0)
        assert first[5, 1] == (2.0, 2.5)  # part 1: the chunks' work less the lead before the last split point
        assert first[0, 1] == (5.0, 5.2)  # the last part after the generation ends


def test_the_search_space_prices_chunked_rows_and_the_mcmc_may_take_them(graph):
    """Every stream row of the disaggregated generation also comes in 2 and 4 chunks; a chunked plan round-trips
    through the space, both simulators agree on it, and the MCMC's winner over the disaggregated placements is
    the best of every (R, chunks) entry by exhaustive pricing; the summary names the chunks."""
    from types import SimpleNamespace

    from realloc.estimator.tail_cost import TAIL_GRID, tail_rows
    from realloc.search.engine import run_mcmc
    from realloc.search.tail_report import tail_summary

    def keep(call: str, o) -> bool:
        mesh, dp = DISAGGREGATED[call][0], DISAGGREGATED[call][1]
        return o.mesh.name == mesh and o.strategy.dp == dp and o.strategy.pp == 1
    space = PlanSpace.build(graph, CostModel(graph, discover=False), option_filter=keep, max_n_mbs=1)
    base = ExecutionPlan.by_hand(graph, DISAGGREGATED)
    priced = {}
    for r in {tail_rows(32, s) for s in TAIL_GRID}:
        for k in (1, 2, 4):
            t = TailMigration(rows=r, instances=0, chunks=k)
            idx = space.indices_of(base.model_copy(update={"tail": {"actor_gen": t}}))
            assert space.to_plan(idx, "x").tail == {"actor_gen": t}
            assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
            priced[r, k] = space.evaluate(idx)["time"]
    out = run_mcmc(space, max_evals=6000, time_limit=None, n_threads=1)
    plan = space.to_plan(out.indices, "search")
    t = plan.tail["actor_gen"]
    assert priced[t.rows, t.chunks] == min(priced.values()) == plan.estimated_time
    report = SimpleNamespace(no_tail=space.to_plan(space.indices_of(base), "x"), space=space, plan=plan,
                             indices=out.indices, graph=graph)
    chunks = f" in {t.chunks} chunks, the last" if t.chunks > 1 else ""
    assert tail_summary(report)[0].startswith(f"streaming: actor_gen hands its finished rows on{chunks} once at most "
                                              f"{t.rows} of 32 rows")


def test_split_thresholds_are_the_workers_and_the_estimators():
    """The thresholds the worker decodes to are the ones the estimator prices (one function), descending to R."""
    for n, r, k in ((32, 2, 4), (32, 6, 2), (8, 1, 7)):
        th = split_thresholds(n, r, k)
        assert th[-1] == r and list(th) == sorted(th, reverse=True) and len(set(th)) == k
