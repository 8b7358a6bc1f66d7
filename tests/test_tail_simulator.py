"""Long-tail migration in both plan simulators (issue 31 item 3): the C++ engine against the Python reference on
random problems with random tails, and both against a schedule computed by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
from test_async_simulator import _with_staleness
from test_simulator import assert_agrees, bounded_evaluations, random_plan, random_problem

from realloc.search import reference
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem
from realloc.search.tail_problem import TailColumns, TailSplit
from realloc.search.tail_reference import TailView

STEPS = [0.0, 0.25, 0.5, 1.0, 1.5]


def random_tails(rng: np.random.Generator, p: SearchProblem, stream: float = 0.0) -> SearchProblem:
    """``p`` with random migrations on some calls' single-stage candidates and random splits of their consumers;
    with ``stream`` > 0, that share of the tails keeps the whole mesh (streaming without migration, any size)."""
    if p.shares_cores:
        return p
    n_grid = int(rng.integers(1, 4))
    columns = []
    for c, k in enumerate(p.candidates):
        if rng.random() < 0.65:  # most calls do not migrate, so that some consumers split
            continue
        grid, width, time = [], [], []
        for i in range(len(k)):
            size = int(k.dev_hi[i] - k.dev_lo[i])
            whole = bool(stream) and rng.random() < stream
            on = int(k.stage_width[i]) == size and (size > 1 or whole) and rng.random() < 0.8
            grid.append(int(rng.integers(n_grid)) if on else -1)
            if whole:
                width.append(size if on else 0)
                time.append(float(rng.choice(STEPS)) if on else 0.0)
                continue
            width.append(int(rng.choice([1, rng.integers(1, size)])) if on else 0)  # often one device: splits
            time.append(float(rng.choice(STEPS)) if on else 0.0)
        columns.append((c, TailColumns(grid, width, time)))
    tail_calls = {c for c, _ in columns}
    splits, split_calls = [], set()
    for e, (u, v) in enumerate(p.data_edges):
        if u in tail_calls and v not in tail_calls and v not in split_calls and rng.random() < 0.8:
            shape = (len(p.candidates[v]), n_grid)
            share = rng.choice([0.25, 0.5, 0.75], size=n_grid)
            splits.append(TailSplit(e, rng.choice(STEPS, size=shape), rng.choice(STEPS, size=shape), share, 1 - share))
            split_calls.add(v)
    return dataclasses.replace(p, tail_columns=tuple(columns), tail_splits=tuple(splits))


def test_cpp_matches_python_reference_on_random_problems_with_random_tails():
    rng = np.random.default_rng(3131)
    n_tails = n_splits = 0
    for trial in range(400):
        p = random_tails(rng, random_problem(rng))
        if trial % 4 == 3:  # generation running ahead too (bounded staleness)
            p = _with_staleness(rng, p)
        cpp = p.to_cpp()
        for _ in range(3):
            plan = random_plan(rng, p)
            assert_agrees(cpp, p, plan, trial)
            assert {tuple(r) for r in cpp.missing(plan).tolist()} == reference.missing_pairs(p, plan), trial
            view = TailView(p, plan)
            n_tails += sum(view.grid(c) >= 0 for c in view.columns)
            n_splits += sum(view.split(c) is not None for c in view.split_of)
    # the random problems migrate tails and split consumers often
    assert n_tails > 150 and n_splits > 30, (n_tails, n_splits)


def test_cpp_matches_python_reference_with_stream_only_tails():
    """Streaming without migration (a tail on the whole mesh, docs/tail-semantics.md): both simulators agree, and
    streams happen (consumers off the mesh split)."""
    rng = np.random.default_rng(3132)
    n_streams = n_splits = 0
    for trial in range(300):
        p = random_tails(rng, random_problem(rng), stream=0.5)
        if trial % 4 == 3:
            p = _with_staleness(rng, p)
        cpp = p.to_cpp()
        for _ in range(3):
            plan = random_plan(rng, p)
            assert_agrees(cpp, p, plan, trial)
            view = TailView(p, plan)
            whole = [c for c in view.columns if view.grid(c) >= 0 and len(view.tail_devices(c)) ==
                     int(p.candidates[c].dev_hi[plan[c]] - p.candidates[c].dev_lo[plan[c]])]
            n_streams += len(whole)
            n_splits += sum(view.split(c) is not None and view.split(c)[1] in whole for c in view.split_of)
    assert n_streams > 100 and n_splits > 10, (n_streams, n_splits)


def test_bounded_evaluation_with_tails_stops_only_above_the_limit():
    """The MCMC's early rejection with tails: a run that completes equals evaluate(); one that stops costs more
    than the limit and is no better than the best (the path and busy-device bounds stay lower bounds)."""
    n_stopped, n_complete = bounded_evaluations(np.random.default_rng(77),
                                                lambda rng: random_tails(rng, random_problem(rng)), never_better=True)
    assert n_stopped > 50 and n_complete > 50


def _one(lo: int, hi: int, time: float) -> CandidateArrays:
    return CandidateArrays(dev_lo=[lo], dev_hi=[hi], stage_width=[hi - lo], layout=[0], mesh_id=[0], shape_class=[0],
                           time=[time], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0], mem_param=[0])


def test_a_migrating_generation_frees_its_other_devices_for_part_one_by_hand():
    """Generation on devices 0-3 (phase 1: 2 s) keeps device 0 for its tail (3 s); a consumer on devices 2-3 runs
    part 1 (1 s) from the migration point and part 2 (0.5 s) once the generation ends; a train call on devices 0-3
    waits for both. Transfers are free; no dispatch latency."""
    p = SearchProblem(
        n_devices=4, device_memory=1 << 30, call_names=("gen", "inf", "train"), call_model=(0, 1, 2),
        model_names=("a", "b", "c"), model_home=(0, 1, 2),
        candidates=(_one(0, 4, 2.0), _one(2, 4, 9.0), _one(0, 4, 1.0)), order_edges=(), carry_edges=((2, 0),),
        data_edges=((0, 1), (1, 2)), data_costs=(PairCosts.dense(np.zeros((1, 1))), PairCosts.dense(np.zeros((1, 1)))),
        realloc_costs=tuple(PairCosts(1, 1) for _ in range(3)), n_iterations=3,
        tail_columns=((0, TailColumns([0], [1], [3.0])),),
        tail_splits=(TailSplit(0, [[1.0]], [[0.5]], [0.8], [0.2]),))
    plan = np.zeros(3, np.int32)
    for sched in (reference.schedule(p, plan),
                  [dict(kind=r[0], call=r[1], iteration=r[3], start=r[4], end=r[5]) for r in p.to_cpp().schedule(plan)]):
        first = {(r["kind"], r["call"]): (r["start"], r["end"]) for r in sched if r["iteration"] == 0}
        assert first[0, 0] == (0.0, 2.0)  # phase 1 on all four devices
        assert first[3, 0] == (2.0, 5.0)  # migration + phase 2, device 0 only
        assert first[5, 1] == (2.0, 3.0)  # part 1 on the freed devices 2-3
        assert first[0, 1] == (5.0, 5.5)  # part 2 after the generation ends
        assert first[0, 2] == (5.5, 6.5)
    # the same consumer on the tail's device runs once, after the generation, at its full time
    q = dataclasses.replace(p, candidates=(p.candidates[0], _one(0, 2, 9.0), p.candidates[2]))
    first = {(r["kind"], r["call"]): (r["start"], r["end"]) for r in reference.schedule(q, plan) if r["iteration"] == 0}
    assert first[0, 1] == (5.0, 14.0) and first[5, 1] == (2.0, 2.0)
    assert reference.evaluate(q, plan) == q.to_cpp().evaluate(plan)
