"""Streaming across pools as a plan choice (issue 32; ``TailMigration.micro_batches``, estimator/mb_stream_cost.py,
search/mb_stream_space.py): the field and its checks, its pricing against the plain call's and a smaller batch's
costs, both plan simulators on random two-pool problems with tails, and the search offering it on pools only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_simulator import assert_agrees, random_plan, random_problem
from test_stream_chunks_plan import _chunked
from test_tail_simulator import random_tails

from realloc.api import load_experiment
from realloc.estimator.chunk_cost import _request
from realloc.estimator.cost import CostModel
from realloc.estimator.mb_stream_cost import MB_GRID, last_rows, mb_chunk_work, mb_generation_cost, mb_lead_shares
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.tail import TailMigration, split_thresholds
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.strategy import ParallelStrategy as S

TWO_KINDS = "experiments/ppo_tiny_two_kinds.py"  # cpu0 (cpu, fp32) + cpu1 (cpu-bf16), fixed lengths, batch 32
ENTRY = TailMigration(rows=8, instances=0, chunks=3, micro_batches=True)


@pytest.fixture(scope="module")
def graph():
    return build_graph(load_experiment(TWO_KINDS))


def _places(gen_mbs: int):
    one = lambda mesh, m=1: (mesh, 1, 1, 1, m)  # noqa: E731
    return {"actor_gen": one("cpu0", gen_mbs), "actor_train": one("cpu0"), "rew_inf": one("cpu1"),
            "ref_inf": one("cpu1"), "critic_inf": one("cpu1"), "critic_train": one("cpu1")}


def test_a_micro_batch_entry_validates_round_trips_and_shows(graph, tmp_path):
    assert ENTRY.model_dump() == {"rows": 8, "instances": 0, "chunks": 3, "micro_batches": True}
    assert "micro_batches" not in TailMigration(rows=8, instances=0, chunks=3).model_dump()  # the JSON of before
    plan = ExecutionPlan.by_hand(graph, _places(4), tail={"actor_gen": ENTRY})
    validate_plan(plan, graph)
    plan.save(tmp_path / "p.json")
    assert ExecutionPlan.load(tmp_path / "p.json").tail == {"actor_gen": ENTRY}
    assert "tail: actor_gen hands each of its 4 micro-batches to the next calls as it ends" in plan.table(
        graph.topo_order)
    # the thresholds count exactly the rows of the micro-batches after each split point (4 of 8 rows each)
    assert split_thresholds(32, last_rows(32, 4), 3) == (24, 16, 8)
    with pytest.raises(ValueError, match="'actor_gen'.*only a stream-only entry.*micro-batches"):
        validate_plan(ExecutionPlan.by_hand(graph, {**_places(4), "actor_gen": ("cpu0", 1, 1, 1, 4)},
                                            tail={"actor_gen": TailMigration(rows=8, instances=1, micro_batches=True)}),
                      graph)


def test_show_names_the_pool_of_the_generation_and_of_each_call_it_streams_to(graph, tmp_path, capsys):
    from realloc import cli

    ExecutionPlan.by_hand(graph, _places(4), tail={"actor_gen": ENTRY}).save(tmp_path / "p.json")
    assert cli.main(["show", TWO_KINDS, "--plan", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert ("stream     actor_gen on pool 0 hands its micro-batches on to: rew_inf on pool 1, ref_inf on pool 1, "
            "critic_inf on pool 1") in out
    bad = ExecutionPlan.by_hand(graph, _places(4)).model_copy(
        update={"tail": {"actor_gen": TailMigration(rows=8, instances=1, micro_batches=True)}})
    bad.save(tmp_path / "bad.json")
    assert cli.main(["show", TWO_KINDS, "--plan", str(tmp_path / "bad.json")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only a stream-only entry (instances=0) hands its micro-batches on" in err[0]


def test_micro_batch_pricing_by_hand(graph):
    """The generation: the plain call's micro-batches one after another, split after each but the last; a
    consumer's chunk: the call on a batch of one micro-batch's rows (all of length gen_len), priced on a graph of
    that batch size; a later chunk adds its request, its transfer's, and a message on the pool link."""
    cost = CostModel(graph)
    mesh = graph.spec.cluster.mesh("cpu0")
    inf_mesh = graph.spec.cluster.mesh("cpu1")
    s = S(1, 1, 1)
    for m in (2, 4):
        tc, lead = mb_generation_cost(cost, "actor_gen", mesh, s, m)
        hw = cost.at(mesh).hw
        tau = (cost.call_cost("actor_gen", mesh, s, m).time - hw.call_overhead) / m
        req = hw.call_overhead + hw.dispatch_latency
        assert tc.phase1 == pytest.approx(hw.call_overhead + (m - 1) * tau + (m - 2) * req)
        assert tc.phase2 == pytest.approx(tau + hw.call_overhead)
        assert lead == pytest.approx((m - 2) * (tau + req))
        small = build_graph(dataclasses.replace(graph.spec, batch_size=32 // m))
        want = CostModel(small).call_cost("ref_inf", inf_mesh, s, 1).time
        chunks, last = mb_chunk_work(cost, "ref_inf", "actor_gen", inf_mesh, s, 1, m)
        inf_hw = cost.at(inf_mesh).hw
        extra = _request(cost, inf_mesh) + inf_hw.call_overhead + graph.spec.cluster.pool_link_latency
        assert chunks == pytest.approx((want,) + (want + extra,) * (m - 2))
        assert last == pytest.approx(want + inf_hw.call_overhead)
    assert mb_lead_shares(4, 1) == (1.0, 0.5) and mb_lead_shares(4, 2) == (0.5, 0.25) and mb_lead_shares(2, 1) == ()


def _with_pools(rng: np.random.Generator, p):
    """``p`` on a cluster of 2 or 3 pools of random usable memory (the split points at random devices)."""
    if p.n_devices < 2:
        return p
    cuts = sorted(rng.choice(np.arange(1, p.n_devices), size=min(p.n_devices - 1, int(rng.integers(1, 3))),
                             replace=False).tolist())
    memory = tuple(int(p.device_memory * f) for f in rng.choice([0.5, 1.0, 2.0], size=len(cuts) + 1))
    return dataclasses.replace(p, pool_start=(0, *cuts), pool_memory=memory)


def test_cpp_matches_python_reference_on_random_two_pool_problems_with_tails():
    rng = np.random.default_rng(3232)
    n_pooled = 0
    for trial in range(300):
        p = _with_pools(rng, _chunked(rng, random_tails(rng, random_problem(rng), stream=0.5)))
        n_pooled += bool(p.pool_start and p.tail_splits)
        cpp = p.to_cpp()
        for _ in range(3):
            assert_agrees(cpp, p, random_plan(rng, p), trial)
    assert n_pooled > 20, n_pooled


def test_the_search_offers_micro_batches_on_pools_only_and_takes_the_best(graph):
    """On two pools every generation candidate at pp 1 with n_mbs in the grid gets a micro-batch row (fixed lengths:
    no row streaming); each such plan round-trips and both simulators agree on it; the MCMC over the placement
    above finds the best entry by exhaustive pricing. One pool (ppo_tiny.py): no tail row at all, as before."""
    from realloc.search.engine import run_mcmc

    cost = CostModel(graph)
    places = _places(1)

    def keep(call: str, o) -> bool:
        return o.mesh.name == places[call][0] and o.strategy == S(1, 1, 1)
    space = PlanSpace.build(graph, cost, option_filter=keep)
    c = space.problem.call_names.index("actor_gen")
    rows = [space.tail_of(c, i) for i in range(len(space.options[c]))]
    entries = {t for t in rows if t is not None}
    assert entries and all(t.micro_batches for t in entries)
    assert {t.chunks + 1 for t in entries} == {m for m in MB_GRID
                                               if any(o.n_mbs == m for o in space.options[c])}
    priced = {}
    for i, t in enumerate(rows):
        o = space.options[c][i]
        plan = ExecutionPlan.by_hand(graph, {**places, "actor_gen": ("cpu0", 1, 1, 1, o.n_mbs)},
                                     tail={} if t is None else {"actor_gen": t})
        idx = space.indices_of(plan)
        assert space.to_plan(idx, "x").tail == plan.tail
        assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
        priced[o.n_mbs, t] = space.evaluate(idx)["time"]
    out = run_mcmc(space, max_evals=6000, time_limit=None, n_threads=1)
    assert space.to_plan(out.indices, "search").estimated_time == min(priced.values())
    one = build_graph(load_experiment("experiments/ppo_tiny.py"))
    alone = PlanSpace.build(one, CostModel(one), max_n_mbs=4)
    assert not alone.tails or all(t is None for k in alone.tails for t in k)


def test_a_start_with_a_tail_row_maps_to_its_plain_candidate_without_tails(graph):
    """The search's first third runs without tails from its starts; a start that streams (the strongest pool's
    own plan, on a cluster of pools whose lengths vary) stands for its candidate without the tail."""
    from realloc.search.tail_space import without_tails

    space = PlanSpace.build(graph, CostModel(graph))
    c = space.problem.call_names.index("actor_gen")
    i = next(i for i in range(len(space.options[c])) if space.tail_of(c, i) is not None)
    start = space.indices_of(ExecutionPlan.by_hand(graph, _places(space.options[c][i].n_mbs)))
    start[c] = i
    restricted, (mapped,) = without_tails(space, [start])
    assert restricted.options[c][int(mapped[c])] == space.options[c][i]
    assert restricted.tail_of(c, int(mapped[c])) is None
