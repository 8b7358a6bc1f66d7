"""The planner's price of a home that keeps its parameters across a narrowing trip (search/home_keep.py,
csrc/home_keep.cpp): the skipped way back costs nothing, by hand, in C++ and Python alike, by the runtime's own
rule (runtime/control/pool_dtypes.py), and the kept copy is in home's memory."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_simulator import random_plan, random_problem

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.search import reference
from realloc.search.home_keep import narrows, skipped_returns
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem

TWO_KINDS = "experiments/ppo_tiny_two_kinds.py"  # pool 0: cpu0 (cpu, fp32); pool 1: cpu1 (cpu-bf16)


def _gen_train(home_pool: int, narrowing: bool) -> SearchProblem:
    """tests/test_simulator.py's actor (gen 2.0 s, train 3.0 s, moves 0.75 s out of home and 0.5 s back), with
    train on pool ``home_pool`` (2 devices) and gen on the other."""
    train_lo, gen_lo = (0, 2) if home_pool == 0 else (2, 0)
    cands = (
        CandidateArrays(dev_lo=[gen_lo], dev_hi=[gen_lo + 2], stage_width=[2], layout=[1], mesh_id=[0],
                        shape_class=[0], time=[2.0], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0],
                        mem_param=[5]),
        CandidateArrays(dev_lo=[train_lo], dev_hi=[train_lo + 2], stage_width=[1], layout=[0], mesh_id=[1],
                        shape_class=[0], time=[3.0], mem_offset=[0, 2], mem_static=[10, 12], mem_dynamic=[1, 4],
                        mem_param=[0, 0]),
    )
    table = ((False, narrowing), (False, False)) if home_pool == 0 else ((False, False), (narrowing, False))
    return SearchProblem(n_devices=4, device_memory=100, call_names=("gen", "train"), call_model=(0, 0),
                         model_names=("actor",), model_home=(1,), candidates=cands, order_edges=(),
                         carry_edges=((1, 0),), data_edges=((0, 1),),
                         data_costs=(PairCosts.dense(np.zeros((2, 2))),),
                         realloc_costs=(PairCosts.dense(np.array([[0.0, 0.75], [0.5, 0.0]])),), n_iterations=4,
                         pool_start=(0, 2), pool_memory=(100, 100),
                         pool_narrows=table if narrowing else (), train_calls=(1,) if narrowing else ())


def test_the_skipped_way_back_costs_nothing_by_hand():
    plan = np.zeros(2, np.int32)
    # Home (train) in fp32, gen in bf16: home keeps its parameters, the move back (0.5 s) is skipped. An
    # iteration is move out 0.75 + gen 2.0 + train 3.0 = 5.75 s; moved both ways it is 6.25 s.
    kept, moved = _gen_train(0, True), _gen_train(0, False)
    for p, want in ((kept, 5.75), (moved, 6.25), (_gen_train(1, True), 5.75), (_gen_train(1, False), 6.25)):
        got = p.to_cpp().evaluate(plan)
        assert got["time"] == pytest.approx(want) and got == reference.evaluate(p, plan)
    assert skipped_returns(kept, plan) == {1} and skipped_returns(moved, plan) == set()
    sched = [(r[0], r[1], r[5] - r[4]) for r in kept.to_cpp().schedule(plan) if r[3] == 1 and r[0] == 1]
    assert sched == [(1, 0, 0.75), (1, 1, 0.0)]  # the move out; the move back into train takes no time
    # Memory: home's parameters are its static memory all the time (train's 10 and 12 bytes), which is the kept
    # copy; gen's copy (5) is gen's while it runs: the same peaks either way.
    mem = kept.to_cpp().memory(plan)
    assert mem["device_static"] == [10, 12, 0, 0] and mem["device_peak"] == [11, 16, 5, 5]
    assert mem == moved.to_cpp().memory(plan)


def test_the_rule_matches_the_runtimes_on_every_placement_of_two_kinds():
    """Every placement of ppo_tiny's calls on cpu (fp32) and cpu-bf16: the calls whose incoming reallocation the
    planner prices at 0 are those whose reallocation the runtime skips (pool_dtypes.DtypeRoutes)."""
    from realloc.runtime.control.pool_dtypes import DtypeRoutes, casts_exactly
    from realloc.runtime.control.program import PARAM_DTYPES, RuntimeProgram
    from realloc.search.build import PlanSpace

    for a, b in itertools.product(PARAM_DTYPES, repeat=2):
        assert narrows(a, b) == (not casts_exactly(PARAM_DTYPES[a][0], PARAM_DTYPES[b][0]))
    graph = build_graph(load_experiment(TWO_KINDS))
    space = PlanSpace.build(graph)
    p = space.problem
    assert p.pool_narrows == ((False, True), (False, False)) and p.train_calls
    n_skipped = 0
    for meshes in itertools.product(("cpu0", "cpu1"), repeat=len(p.call_names)):
        plan = ExecutionPlan.by_hand(graph, {c: (m, 1, 1, 1, 1) for c, m in zip(p.call_names, meshes)})
        idx = space.indices_of(plan)
        routes = DtypeRoutes.of(RuntimeProgram(graph, plan))
        want = {p.call_names.index(dst) for _, _, dst in routes.skip}
        assert skipped_returns(p, idx) == want, meshes
        n_skipped += bool(want)
    assert n_skipped >= 8


def _with_pools(rng: np.random.Generator, p: SearchProblem) -> SearchProblem:
    """A random problem on 1-3 pools whose trips narrow at random, with random train calls."""
    n_pools = int(rng.integers(1, min(3, p.n_devices) + 1))
    starts = (0, *sorted(int(x) for x in rng.choice(np.arange(1, p.n_devices), n_pools - 1, replace=False))) \
        if n_pools > 1 else (0,)
    table = tuple(tuple(bool(a != b and rng.random() < 0.7) for b in range(n_pools)) for a in range(n_pools))
    train = tuple(c for c in range(p.n_calls) if rng.random() < 0.4)
    return dataclasses.replace(p, pool_start=starts, pool_memory=tuple([p.device_memory] * n_pools),
                               pool_narrows=table, train_calls=train)


def test_cpp_matches_the_reference_with_kept_homes_on_random_problems_and_walks():
    rng = np.random.default_rng(32)
    n_skips = 0
    for trial in range(300):
        p = _with_pools(rng, random_problem(rng))
        cpp = p.to_cpp()
        plans = [random_plan(rng, p)]
        for _ in range(5):  # a walk: one evaluator follows plans that differ in a call or two
            plan = plans[-1].copy()
            for c in rng.choice(p.n_calls, size=min(p.n_calls, int(rng.integers(1, 3))), replace=False):
                plan[c] = rng.integers(0, len(p.candidates[c]))
            plans.append(plan)
        walk = cpp.evaluate_batch(np.stack(plans))
        for i, plan in enumerate(plans):
            want = reference.evaluate(p, plan)
            assert cpp.evaluate(plan) == want, trial
            assert (walk["time"][i], walk["cost"][i]) == (want["time"], want["cost"]), trial
            assert {tuple(r) for r in cpp.missing(plan).tolist()} == reference.missing_pairs(p, plan), trial
            n_skips += bool(skipped_returns(p, plan))
    assert n_skips > 50
