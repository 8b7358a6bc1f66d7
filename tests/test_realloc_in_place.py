"""Reallocations that copy in place (issue 31, docs/streaming.md "Where the fused plans lose time"): a source that
holds the whole model on every device (tp 1, pp 1) into a mesh inside it. The runtime's planner moves no byte
between devices for them, so the master waits only for the destination's ranks (master_schedule._wait_realloc), and
both simulators occupy only the destination's devices."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from realloc.cluster import ClusterSpec
from realloc.graph.transfer_plan import Layout, plan_param_realloc
from realloc.models.config import get_model_config
from realloc.search import reference
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem
from realloc.strategy import ParallelStrategy as S
from test_simulator import assert_agrees, bounded_evaluations, random_plan, random_problem


def test_planner_moves_nothing_from_a_whole_source_into_a_mesh_inside_it() -> None:
    """The fact the simulators rely on, from the runtime's own planner: every destination shard comes from the
    device's own copy (no bytes sent or received), for every strategy of every submesh of a dp-4 source."""
    cfg = get_model_config("tiny")
    c = ClusterSpec.from_nodelist("n1", 4)
    src = Layout(c.mesh("n1"), S(dp=4, tp=1, pp=1))
    checked = 0
    for name in ("n1:0", "n1:1", "n1:2", "n1:3", "n1:0-1", "n1:2-3", "n1"):
        mesh = c.mesh(name)
        n = len(mesh.device_ids)
        for dp, tp in itertools.product(range(1, n + 1), repeat=2):
            if n % (dp * tp):
                continue
            plan = plan_param_realloc(cfg, src, Layout(mesh, S(dp=dp, tp=tp, pp=n // (dp * tp))))
            assert not any(plan.sent_bytes.values()) and not any(plan.received_bytes.values()), (name, dp, tp)
            checked += 1
    assert checked > 10
    # and not from a tp-2 source: the other half of each matrix lives on the other device
    plan = plan_param_realloc(cfg, Layout(c.mesh("n1:0-1"), S(dp=1, tp=2, pp=1)),
                              Layout(c.mesh("n1:1"), S(dp=1, tp=1, pp=1)))
    assert any(plan.received_bytes.values())


def _cands(lo: int, hi: int, time: float, whole: int, layout: int) -> CandidateArrays:
    return CandidateArrays(dev_lo=[lo], dev_hi=[hi], stage_width=[hi - lo], layout=[layout],
                           mesh_id=[0], shape_class=[0], time=[time], mem_offset=[0, 1], mem_static=[0],
                           mem_dynamic=[0], mem_param=[0], whole=[whole])


def test_in_place_realloc_waits_only_for_its_destination_devices() -> None:
    """Hand-computed: model 0's train call t (devices 0-1, 1 s) is followed by its inference call i (device 1);
    the generation g of model 1 runs 3 s on device 0 after t. Each reallocation takes 0.5 s (the chain wraps: i -> t
    opens the iteration, so t runs 0.5-1.5 s and g 1.5-4.5 s). In place, t -> i starts when t ends, on device 1
    beside g; otherwise it waits for device 0 until g ends."""
    for whole, realloc_start in ((1, 1.5), (0, 4.5)):
        t, g, i = _cands(0, 2, 1.0, whole, 0), _cands(0, 1, 3.0, 1, 0), _cands(1, 2, 1.0, 1, 1)
        table = PairCosts(2, 2, provisional=0.0)
        table.known[0, 1] = table.known[1, 0] = 0.5
        p = SearchProblem(
            n_devices=2, device_memory=2**30, call_names=("t", "g", "i"), call_model=(0, 1, 0),
            model_names=("m0", "m1"), model_home=(0, 1), candidates=(t, g, i), order_edges=((0, 1),),
            carry_edges=(), data_edges=(), data_costs=(), realloc_costs=(table, PairCosts(1, 1)), n_iterations=3,
            oom_alpha=10.0)
        plan = np.zeros(3, np.int32)
        _, sched = assert_agrees(p.to_cpp(), p, plan, whole)
        first = next(r for r in sched if r[0] == reference.REALLOC and r[1] == 2 and r[3] == 0)
        assert (first[4], first[5]) == (realloc_start, realloc_start + 0.5), (whole, first)


def _whole_at_random(rng: np.random.Generator) -> SearchProblem:
    p = random_problem(rng)
    return dataclasses.replace(p, candidates=tuple(
        dataclasses.replace(c, whole=rng.integers(0, 2, len(c))) for c in p.candidates))


def test_simulators_agree_with_in_place_reallocations() -> None:
    """C++ against the Python reference on random problems whose candidates hold the whole model at random, three
    plans each on one engine (its incremental re-pricing switches in-place reallocations on and off), and the
    bounded evaluation the MCMC uses."""
    rng = np.random.default_rng(31)
    n_in_place = 0
    for k in range(250):
        p = _whole_at_random(rng)
        cpp = p.to_cpp()
        for _ in range(3):
            plan = random_plan(rng, p)
            assert_agrees(cpp, p, plan, k)
            n_in_place += sum(reference._in_place(p, plan, a, b) for a in range(p.n_calls) for b in range(p.n_calls)
                              if a != b and p.call_model[a] == p.call_model[b])
    assert n_in_place > 50
    stopped, completed = bounded_evaluations(rng, _whole_at_random, n_problems=100)
    assert stopped and completed


def test_simulators_agree_with_in_place_reallocations_beside_tails_and_staleness() -> None:
    """The same with random tail migrations, streamed consumers and (a quarter of the problems) bounded staleness."""
    from test_async_simulator import _with_staleness
    from test_tail_simulator import random_tails

    rng = np.random.default_rng(3132)
    for k in range(200):
        p = random_tails(rng, _whole_at_random(rng), stream=0.3)
        if k % 4 == 3:
            p = _with_staleness(rng, p)
        cpp = p.to_cpp()
        for _ in range(3):
            assert_agrees(cpp, p, random_plan(rng, p), k)
