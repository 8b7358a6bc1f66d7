"""The simulators order bounded staleness as the runtime does (csrc/stale.cpp, search/stale_reference.py).

- The runtime's own dependencies: the master's ``IterationSchedule._nodes``/``_deps`` (the code a run waits by, not a
  copy of it) on random plans of PPO, GRPO and ReMax (two generation calls of one model) at staleness 1..3, some
  reading home in place, some a snapshot. The simulator's graph (the Python reference, which the C++ engine equals
  node for node) orders its calls and reallocations exactly as the runtime's graph does (the same transitive
  order), and its schedule starts every node after the runtime's dependencies ended.
- C++ and Python agree on random problems with several stale calls per model (snapshots shared by a layout, read in
  place), with and without tails, at staleness 0..3; the C++ engine's early rejection stays sound on them.
- By hand: a generation reading home in place makes the train step of t wait for the generation of t + eta; at
  staleness 2 with a snapshot, the snapshot for t waits for the generation of t - 1 (one copy).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_simulator import assert_agrees, bounded_evaluations, random_plan, random_problem
from test_tail_simulator import random_tails

from realloc.search import reference
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem
from realloc.search.reference import CALL, REALLOC


def with_stale_calls(rng: np.random.Generator, p: SearchProblem, eta: int) -> SearchProblem:
    """Mark the leading calls of some models stale (up to all but one, as generation before the train step), and
    drop their inputs within the iteration, as generation has none (the runtime would wait in a circle: the train
    step of t waits for the generation of t + eta)."""
    if eta == 0 or p.tail_columns:  # (a tail's consumer split keeps its data edge)
        return p
    stale = []
    for m in range(p.n_models):
        calls = [c for c in range(p.n_calls) if p.call_model[c] == m]
        stale += calls[:len(calls) - 1 if rng.random() < 0.5 else int(rng.integers(0, len(calls)))]
    keep = [e for e, (_, v) in enumerate(p.data_edges) if v not in stale]
    return dataclasses.replace(p, staleness=eta, stale_calls=tuple(sorted(stale)),
                               data_edges=tuple(p.data_edges[e] for e in keep),
                               data_costs=tuple(p.data_costs[e] for e in keep),
                               order_edges=tuple((u, v) for u, v in p.order_edges if v not in stale))


def test_cpp_matches_python_with_several_stale_calls_per_model_and_tails():
    rng = np.random.default_rng(3333)
    seen = {"in_place": 0, "shared_copy": 0, "snapshot": 0}
    for trial in range(500):
        p = with_stale_calls(rng, random_problem(rng), trial % 4)
        if trial % 2:
            p = random_tails(rng, p, stream=0.3)
        cpp = p.to_cpp()
        for _ in range(2):
            plan = random_plan(rng, p)
            assert_agrees(cpp, p, plan, trial)
            assert {tuple(r) for r in cpp.missing(plan).tolist()} == reference.missing_pairs(p, plan), trial
            layout = [int(p.candidates[c].layout[plan[c]]) for c in range(p.n_calls)]
            for c in p.stale_calls if p.staleness else ():
                calls = [x for x in range(p.n_calls) if p.call_model[x] == p.call_model[c]]
                home = [x for x in calls if x not in p.stale_calls][-1]
                earlier = [x for x in calls if x < c and x in p.stale_calls]
                seen["in_place" if layout[c] == layout[home] else
                     "shared_copy" if any(layout[x] == layout[c] for x in earlier) else "snapshot"] += 1
    assert min(seen.values()) > 25, seen


def test_bounded_evaluation_stays_sound_with_gates_and_backward_edges():
    """The MCMC's early rejection (the path bound skips gates and edges back to an earlier iteration; the busy-device
    bound): a run that completes equals evaluate(), one that stops costs more than its limit."""
    n_stopped, n_complete = bounded_evaluations(
        np.random.default_rng(3434), lambda rng: with_stale_calls(rng, random_problem(rng), int(rng.integers(1, 4))),
        never_better=True)
    assert n_stopped > 25 and n_complete > 100, (n_stopped, n_complete)


# -- the runtime's dependencies --------------------------------------------------------------------------------


def runtime_graph(program, n_iterations: int) -> dict:
    """Node -> its dependencies, from the master's own schedule code (no saves, evaluation or offload)."""
    from realloc.runtime.control.master import Master

    m = Master.__new__(Master)  # only the schedule's state: no sockets, no workers
    m.program, m.graph, m.spec = program, program.graph, program.graph.spec
    m.start, m.end = 0, n_iterations
    m.save_every = m.export_every = 0
    m.save_final = False
    m.offloaded, m.eval_calls, m.splits = set(), None, {}
    return {n: m._deps(n) for t in range(n_iterations) for n in m._nodes(t)}


def closure(deps: dict) -> dict:
    """Node -> every node it waits for, directly or not."""
    out: dict = {}

    def visit(n):
        if n not in out:
            out[n] = set()
            for d in deps.get(n, ()):
                out[n] |= {d} | visit(d)
        return out[n]

    for n in deps:
        visit(n)
    return out


def simulator_graph(space, idx, program) -> tuple[dict, dict]:
    """The reference simulator's nodes as the runtime's (call, reallocation, snapshot) and, per such node, the
    others it waits for through transfers, gates and free reallocations; and each one's (start, end)."""
    from realloc.runtime.control.master_schedule import Node

    p = space.problem
    nodes = reference._build_nodes(p, idx)
    names = p.call_names
    layout = [int(p.candidates[c].layout[idx[c]]) for c in range(p.n_calls)]

    def as_runtime(nd):
        model = program.calls[names[nd.call]].model
        if nd.kind == CALL:
            return Node("call", names[nd.call], nd.iteration)
        moves = nd.cost > 0 or layout[nd.other] != layout[nd.call] and nd.call not in p.stale_calls
        if nd.kind == REALLOC and moves and not program.is_rule(model):  # a rule has no parameters to move
            return Node("realloc", model, nd.iteration, names[nd.other], names[nd.call])
        return None

    runtime = [as_runtime(nd) for nd in nodes]
    deps: dict = {}

    # Known and left (not staleness): the simulator chains every model's calls through free reallocations, and the
    # runtime orders an untrained model's calls in one layout only by its data (ReMax's reward calls).
    def frozen_chain(j):
        nd = nodes[j]
        return (nd.kind == REALLOC and runtime[j] is None and nd.call not in p.stale_calls
                and program.train_call(program.calls[names[nd.call]].model) is None)

    def mapped_parents(i, seen):
        for j in nodes[i].parents:
            if j in seen or frozen_chain(j):
                continue
            seen.add(j)
            if runtime[j] is not None:
                yield runtime[j]
            else:
                yield from mapped_parents(j, seen)

    for i, r in enumerate(runtime):
        if r is not None:
            deps[r] = set(mapped_parents(i, set()))
    sched = reference.schedule(p, idx)
    times = {r: (s["start"], s["end"]) for r, s in zip(runtime, sched) if r is not None}
    return deps, times


@pytest.mark.parametrize("exp,eta", [("ppo_tiny", 1), ("ppo_tiny", 2), ("grpo_tiny", 3), ("remax_tiny", 2)])
def test_the_simulator_orders_nodes_as_the_runtime_does(exp, eta):
    from run_helpers import REPO

    from realloc.api import load_experiment
    from realloc.cluster import ClusterSpec
    from realloc.graph.dataflow import build_graph
    from realloc.runtime.control.program import RuntimeProgram
    from realloc.search.build import PlanSpace

    spec = load_experiment(str(REPO / f"experiments/{exp}.py"))
    spec = dataclasses.replace(spec, cluster=ClusterSpec.from_nodelist("localhost", 4, "cpu"), max_staleness=eta)
    graph = build_graph(spec)
    space = PlanSpace.build(graph, offload=False, migrate=False, prune_memory=False).with_staleness(eta)
    p = space.problem
    rng = np.random.default_rng(eta)
    kinds, checked = set(), 0
    for _ in range(40):
        idx = np.asarray(list(random_plan(rng, p)) + [0] * len(p.fused), np.int32)
        if rng.random() < 0.5:  # generation in the train step's layout: it reads home in place
            for c in (p.call_names.index(g) for g in graph.stale_calls):
                home = p.model_home[p.call_model[c]]
                same = np.flatnonzero(p.candidates[c].layout == p.candidates[home].layout[idx[home]])
                if len(same):
                    idx[c] = rng.choice(same)
        try:
            program = RuntimeProgram(graph, space.to_plan(idx, "test"))
        except ValueError:  # a generation layout that another call of its model reads: the runtime refuses it
            continue
        gens = sorted(graph.stale_calls)
        kinds.add(tuple(program.snapshot_of(g) is None for g in gens))
        want = runtime_graph(program, p.n_iterations)
        got, times = simulator_graph(space, idx, program)
        assert set(got) == set(want)
        assert closure(got) == closure({n: set(d) for n, d in want.items()}), (exp, eta, idx)
        for n, ds in want.items():
            for d in ds:
                assert times[n][0] >= times[d][1], (n, d)
        checked += 1
        if checked == 6:
            break
    assert checked >= 4 and any(all(k) for k in kinds) and any(not any(k) for k in kinds), kinds


# -- by hand ----------------------------------------------------------------------------------------------------


def _gen_train(eta: int, gen_on: tuple[int, int], gen_time: float = 2.0) -> SearchProblem:
    """Generation (gen_time s) on ``gen_on``, training (3 s) on device 1; a 0.75 s copy between their layouts (one
    layout when they share device 1); no dispatch latency. Lookahead eta: the last priced train step waits for the
    generation eta iterations later."""
    same = gen_on == (1, 2)
    cands = (
        CandidateArrays(dev_lo=[gen_on[0]], dev_hi=[gen_on[1]], stage_width=[1], layout=[0 if same else 1], mesh_id=[0],
                        shape_class=[0], time=[gen_time], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0],
                        mem_param=[0]),
        CandidateArrays(dev_lo=[1], dev_hi=[2], stage_width=[1], layout=[0], mesh_id=[1], shape_class=[0],
                        time=[3.0], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0], mem_param=[0]),
    )
    return SearchProblem(n_devices=2, device_memory=100, call_names=("gen", "train"), call_model=(0, 0),
                         model_names=("actor",), model_home=(1,), candidates=cands, order_edges=(),
                         carry_edges=((1, 0), (1, 1)), data_edges=((0, 1),),
                         data_costs=(PairCosts.dense(np.zeros((2, 2))),),
                         realloc_costs=(PairCosts.dense(np.array([[0.0, 0.75], [0.75, 0.0]])),),
                         n_iterations=8, staleness=eta, stale_calls=(0,), lookahead=eta)


def _times(p: SearchProblem) -> dict:
    """(kind, call, iteration) -> (start, end) of each node but the gates; the two simulators agree."""
    plan = np.zeros(2, np.int32)
    _, sched = assert_agrees(p.to_cpp(), p, plan, "by hand")
    return {(r[0], r[1], r[3]): (r[4], r[5]) for r in sched if r[0] != 6}


def test_in_place_generation_holds_the_train_step_until_it_ends_by_hand():
    """Generation in the train step's layout (device 1): no snapshot; the train step of t waits for the generation of
    t + eta, which reads home in place. One device runs both, one after another: gen 2 + train 3 = 5 s an iteration
    at every eta, and the train step of t starts only after the generation of t + eta ended."""
    for eta in (1, 2):
        p = _gen_train(eta, (1, 2))
        rec = _times(p)
        assert not any(k[0] == REALLOC and v[1] > v[0] for k, v in rec.items())  # no copy
        for t in range(p.n_iterations - eta):
            assert rec[CALL, 1, t][0] >= rec[CALL, 0, t + eta][1]
        # past the start (the first eta generations wait for no train step)
        assert dataclasses.replace(p, warmup=3).to_cpp().evaluate(np.zeros(2, np.int32))["time"] == pytest.approx(5.0)


def test_one_copy_at_staleness_2_by_hand():
    """Generation on device 0 (4 s, slower than training) with its own copy, eta 2: the snapshot for iteration t
    overwrites the one copy only after the generation of t - 1 ended, so generation paces the run at gen + copy =
    4.75 s (a copy per iteration in flight would give 4 s)."""
    p = _gen_train(2, (0, 1), gen_time=4.0)
    rec = _times(p)
    for t in range(1, p.n_iterations):
        assert rec[REALLOC, 0, t][0] >= rec[CALL, 0, t - 1][1]
    p = dataclasses.replace(p, warmup=3)
    assert p.to_cpp().evaluate(np.zeros(2, np.int32))["time"] == pytest.approx(4.75)
