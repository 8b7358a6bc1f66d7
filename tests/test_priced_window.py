"""The priced window (csrc/problem.h, docs/search.md "The price of a plan"): warm-up iterations before it and
lookahead iterations after it are simulated but not priced.

- C++ equals the Python reference, evaluation and schedule, on random problems with random windows: plain,
  run-ahead (staleness), long tails, fused pairs, pools with kept homes; the early exit after the window's last
  iteration therefore prices what the whole simulation does.
- The MCMC's bounded evaluation stays sound with a window.
- A plan whose calls of iteration t queue behind calls of t + 1: over 4 iterations without lookahead it is priced
  below its long run (the planner's old price); the window with lookahead prices it at the long run's
  per-iteration time, measured on a 40-iteration schedule of the reference.
- A plan that does not overlap iterations keeps the old price, and the planner's default window refuses an
  ``n_iterations`` that leaves no window.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from realloc.api import load_experiment
from realloc.search import reference
from realloc.search.build import DEFAULT_ITERATIONS, PlanSpace
from realloc.graph.dataflow import build_graph
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem
from test_async_simulator import _with_staleness
from test_fused_search import fused_plan, with_fused_pair
from test_home_keep import _with_pools
from test_simulator import assert_agrees, bounded_evaluations, random_plan, random_problem
from test_tail_simulator import random_tails


def windowed(rng: np.random.Generator, p: SearchProblem) -> SearchProblem:
    """``p`` with 0-2 warm-up and 0-2 lookahead iterations added around its iterations."""
    warmup, lookahead = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    return dataclasses.replace(p, n_iterations=p.n_iterations + warmup + lookahead, warmup=warmup,
                               lookahead=lookahead)


def _fused(rng: np.random.Generator) -> SearchProblem:
    while (p := with_fused_pair(rng, random_problem(rng))) is None:
        pass
    return p


MAKERS = {
    "plain": random_problem,
    "run-ahead": lambda rng: _with_staleness(rng, random_problem(rng)),
    "tails": lambda rng: random_tails(rng, random_problem(rng)),
    "pools and kept homes": lambda rng: _with_pools(rng, random_problem(rng)),
    "fused": _fused,
}


@pytest.mark.parametrize("kind", MAKERS)
def test_cpp_matches_the_reference_over_random_windows(kind):
    rng = np.random.default_rng(3232)
    n_windows = 0
    for trial in range(60):
        p = windowed(rng, MAKERS[kind](rng))
        n_windows += bool(p.warmup or p.lookahead)
        cpp = p.to_cpp()
        assert (cpp.warmup, cpp.lookahead) == (p.warmup, p.lookahead)
        for _ in range(2):
            plan = fused_plan(rng, p) if p.fused else random_plan(rng, p)
            want, sched = assert_agrees(cpp, p, plan, (kind, trial))
            # the price by hand from the whole schedule: the window's iteration ends
            ends = [max(r[5] for r in sched if r[3] == t) for t in range(p.n_iterations)]
            first, last = p.priced_window
            assert want["time"] == (ends[last] - ends[first]) / (last - first)
            assert want["makespan"] == ends[last]
    assert n_windows > 40


@pytest.mark.parametrize("kind", ["plain", "run-ahead", "tails"])
def test_bounded_evaluation_stays_sound_with_a_window(kind):
    n_stopped, n_complete = bounded_evaluations(np.random.default_rng(3233),
                                                lambda rng: windowed(rng, MAKERS[kind](rng)), n_problems=120)
    assert n_stopped > 10 and n_complete > 10


def _one(lo: int, hi: int, time: float) -> CandidateArrays:
    return CandidateArrays(dev_lo=[lo], dev_hi=[hi], stage_width=[hi - lo], layout=[0], mesh_id=[0], shape_class=[0],
                           time=[time], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0], mem_param=[0])


def overlapping(n_iterations: int, warmup: int = 0, lookahead: int = 0) -> SearchProblem:
    """Generation on devices 0-1 (1 s), the actor's train step on 0 (0.5 s), the critic's inference (1.5 s) and train
    step (0.5 s) on 1. The next generation waits only for the actor's step, so it is ready before the critic's step
    and takes device 1 first: the critic's step of iteration t runs after the generation of t + 1."""
    return SearchProblem(
        n_devices=2, device_memory=1, call_names=("gen", "actor_train", "critic_inf", "critic_train"),
        call_model=(0, 0, 1, 1), model_names=("actor", "critic"), model_home=(1, 3),
        candidates=(_one(0, 2, 1.0), _one(0, 1, 0.5), _one(1, 2, 1.5), _one(1, 2, 0.5)),
        order_edges=(), carry_edges=((1, 0), (3, 2)), data_edges=((0, 1), (0, 2), (2, 3)),
        data_costs=tuple(PairCosts(1, 1) for _ in range(3)), realloc_costs=(PairCosts(1, 1), PairCosts(1, 1)),
        n_iterations=n_iterations, warmup=warmup, lookahead=lookahead)


def test_lookahead_prices_an_overlapping_plan_as_its_long_run():
    plan = np.zeros(4, np.int32)
    for p in (overlapping(4), overlapping(DEFAULT_ITERATIONS, 1, 2)):
        assert_agrees(p.to_cpp(), p, plan, p.n_iterations)
    # the long run by the reference: 40 iterations, per-iteration time between iterations 20 and 30
    sched = reference.schedule(overlapping(40), plan)
    ends = [max(r["end"] for r in sched if r["iteration"] == t) for t in range(40)]
    long_run = (ends[30] - ends[20]) / 10
    starts = {(r["call"], r["iteration"]): r["start"] for r in sched if r["kind"] == reference.CALL}
    assert starts[3, 10] > starts[0, 11]  # it overlaps: the critic's step of t after the generation of t + 1
    old = overlapping(4).to_cpp().evaluate(plan)["time"]
    new = overlapping(DEFAULT_ITERATIONS, 1, 2).to_cpp().evaluate(plan)["time"]
    assert (old, long_run) == (pytest.approx(8 / 3), pytest.approx(3.0))  # the 4th has no next generation
    assert new == pytest.approx(long_run, rel=1e-12)


def test_a_plan_that_does_not_overlap_iterations_keeps_its_price():
    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))
    space = PlanSpace.build(graph)
    assert (space.problem.n_iterations, space.problem.priced_window) == (10, (1, 7))
    plan = np.zeros(space.problem.n_calls, np.int32)
    old = dataclasses.replace(space.problem, n_iterations=4, warmup=0, lookahead=0)
    assert space.cpp.evaluate(plan)["time"] == pytest.approx(old.to_cpp().evaluate(plan)["time"], rel=1e-12)
    with pytest.raises(ValueError, match="n_iterations=4: .* use at least 6"):
        PlanSpace.build(graph, n_iterations=4)


def test_a_window_that_leaves_too_few_iterations_is_refused():
    with pytest.raises(ValueError, match="at least 3 priced iterations"):
        overlapping(5, 1, 2).to_cpp()
