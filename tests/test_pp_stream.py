"""Streaming at pp > 1 priced as the runtime runs it (issue 32 / 31 item 2; estimator/pp_stream_cost.py): a step of
every micro-batch through the stages, then the step's tokens back (models/stream_pipeline.py), checked against an
event-by-event schedule of the stages; a hand plan at pp 2 with a stream entry (whole or chunked) is priced so, its
consumers split, both simulators agree on it and on random plans of such a space; pp 1 prices stay as they were."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_length_schedule import pool  # noqa: F401 - the module's gloo pool (two ranks)

from realloc.api import load_experiment
from realloc.estimator.call_time import decode_segments
from realloc.estimator.chunk_cost import chunked_generation_cost
from realloc.estimator.cost import CostModel
from realloc.estimator.mb_stream_cost import MB_GRID, last_rows
from realloc.estimator.opcount import Phase
from realloc.estimator.pp_stream_cost import (STEP_COUNT_BYTES, stepped_generation, stream_generation_cost,
                                              stream_phase1, stream_rest)
from realloc.estimator.stream_cost import stream_phase2
from realloc.estimator.tail_cost import migration_step, phase1_cost, tail_rows
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.graph.tail import TailMigration
from realloc.lengths import ResponseLengths as R
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.search.tail_reference import TailView
from realloc.search.timeline import estimate_plan
from realloc.strategy import ParallelStrategy as S

# generation at pp 2 on devices 0-1, the inference calls on device 2, the train calls on devices 2-3
PP2 = {"actor_gen": ("localhost:0-1", 1, 1, 2, 2), "ref_inf": ("localhost:2", 1, 1, 1, 1),
       "rew_inf": ("localhost:2", 1, 1, 1, 1), "critic_inf": ("localhost:2", 1, 1, 1, 1),
       "actor_train": ("localhost:2-3", 2, 1, 1, 1), "critic_train": ("localhost:2-3", 2, 1, 1, 1)}


@pytest.fixture(scope="module")
def graph():
    spec = load_experiment("experiments/ppo_tiny.py")
    spec = dataclasses.replace(spec, gen_len=64, response_lengths=R.lognormal(4, 51),
                               cluster=dataclasses.replace(spec.cluster, n_devices_per_node=4))
    return build_graph(spec)


@pytest.fixture(scope="module")
def model(graph):
    return CostModel(graph, discover=False)


def _mesh(model, name):
    return next(m for m in model.cluster.device_meshes() if m.name == name)


def _event_schedule(timer, s, links, b, prompt, ends, n_mbs) -> float:
    """The stepped decoding by events: at every step, stage k runs micro-batch i once stage k - 1 has passed it on
    and stage k is done with i - 1; the next step starts when the last micro-batch's tokens are back."""
    clock = 0.0
    steps = [(Phase.PREFILL, b, prompt)] + [(Phase.DECODE, rows, prompt + j)
                                            for first, last, rows in decode_segments(ends)
                                            for j in range(first, last + 1)]
    for phase, rows, ctx in steps:
        host = timer._engine("engine.decode_step", s.tp, rows, prompt, default=timer.hw.decode_step_overhead)
        stage = [st.total for st in timer._stages(phase, s, links, rows, ctx, host=host)]
        done = [[clock] * n_mbs for _ in stage]
        for k, t in enumerate(stage):
            for i in range(n_mbs):
                done[k][i] = max(done[k - 1][i] if k else clock, done[k][i - 1] if i else clock) + t
        clock = done[-1][-1] + timer.comm.time("p2p", 2, 16 * rows, links.pp_any)
    return clock


@pytest.mark.parametrize("pp, n_mbs", [(2, 2), (2, 4), (4, 3)])
def test_a_stepped_generation_is_its_event_schedule(model, pp, n_mbs):
    """Every step waits for the last micro-batch's tokens: no step overlaps the next, unlike the pipelined call."""
    timer = model._timer(model.graph.model_config("actor_gen"), model.call_precision("actor_gen"))
    s = S(1, 1, pp)
    links = model.links(_mesh(model, "localhost" if pp == 4 else "localhost:0-1"), s)
    ends = (3, 5, 5, 9)
    got = stepped_generation(timer, s, links, 4, 8, ends, n_mbs, slots=8 + 9)
    extras = n_mbs * (timer._engine("engine.gen_call", 1, 4, 8) + timer.row_drops(s, ends, 17, 8)
                      + timer.kv_alloc(s, 4, 17, 8 + sum(ends) / 4 - 1))
    assert got == pytest.approx(_event_schedule(timer, s, links, 4, 8, ends, n_mbs) + extras, rel=1e-3)
    plain = timer.generate_varied(s, links, 4, 8, ends, n_mbs, slots=17).time
    assert got > plain  # the pipelined loop hides a stage's bubble behind the other micro-batches


def test_pp1_stream_prices_are_the_ones_of_before(model):
    mesh = _mesh(model, "localhost:0")
    for rows in (2, 6, 13):
        one = stream_phase1(model, "actor_gen", mesh, S(1, 1, 1), 2, rows)
        assert one == phase1_cost(model, "actor_gen", mesh, S(1, 1, 1), 2, rows)
        assert stream_rest(model, "actor_gen", mesh, S(1, 1, 1), 2, rows, one) == stream_phase2(
            model, "actor_gen", mesh, S(1, 1, 1), 2, one)


def test_a_pp2_stream_is_the_stepped_generation_in_two_parts(model):
    mesh, s = _mesh(model, "localhost"), S(2, 1, 2)
    work = model.workload("actor_gen")
    timer = model._timer(model.graph.model_config("actor_gen"), model.call_precision("actor_gen"))
    links = model.links(mesh, s)
    b = work.micro_batch(2, 2)
    for rows in (3, 6):
        got = stream_generation_cost(model, "actor_gen", mesh, s, 2, rows)
        cut = migration_step(model, "actor_gen", rows)
        counts = cut * model.comm.time("all_reduce", 2, STEP_COUNT_BYTES, links.dp)  # a blocking count per step
        whole = stepped_generation(timer, s, links, b, work.prompt_len,
                                   work.lengths.slowest_ends(work.gen_len, b, work.n_seqs), 2, 8 + 64)
        assert got.phase1 + got.phase2 == pytest.approx(whole + counts + 2 * model.hw.call_overhead, rel=1e-12)
        assert 0 < got.phase1 < got.total and got.migration == 0.0
        assert got.total > model.call_cost("actor_gen", mesh, s, 2).time + model.hw.call_overhead


def _plan(graph, tail):
    return ExecutionPlan.by_hand(graph, PP2, tail=tail)


@pytest.mark.parametrize("tail", [TailMigration(rows=6, instances=0), TailMigration(rows=6, instances=0, chunks=2)])
def test_a_hand_plan_streaming_at_pp2_is_priced_stepped_and_splits_its_consumers(graph, model, tail):
    space, idx = estimate_plan(graph, _plan(graph, {"actor_gen": tail}), model)
    names = space.problem.call_names
    g = names.index("actor_gen")
    assert space.tail_of(g, int(idx[g])) == tail
    mesh = _mesh(model, "localhost:0-1")
    want = (stream_generation_cost(model, "actor_gen", mesh, S(1, 1, 2), 2, 6) if tail.chunks == 1 else
            chunked_generation_cost(model, "actor_gen", mesh, S(1, 1, 2), 2, 6, 2)[0])
    assert space.problem.candidates[g].time[int(idx[g])] == want.phase1
    assert space.tails[g][int(idx[g])].tail == want.phase2
    view = TailView(space.problem, idx)
    assert {names[c] for c in view.split_of if view.split(c) is not None} == {"ref_inf", "rew_inf", "critic_inf"}
    assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
    # the same plan without the entry is the pipelined call
    plain_space, plain_idx = estimate_plan(graph, _plan(graph, {}), model)
    assert plain_space.problem.candidates[g].time[int(plain_idx[g])] == model.call_cost(
        "actor_gen", mesh, S(1, 1, 2), 2).time


def test_the_search_space_offers_no_stream_at_pp2_and_keeps_its_prices(graph, model):
    """Only a hand plan's estimate asks for row streaming at pp > 1 (and, on one pool, micro-batch streaming); the
    search's space is the one of before."""
    plain = PlanSpace.build(graph, model, max_n_mbs=2)
    for c, choices in enumerate(plain.tails):
        assert all(t is None or plain.options[c][i].strategy.pp == 1 for i, t in enumerate(choices))
    keep = lambda c, o: o.mesh.size <= 2 and o.n_mbs <= 2  # noqa: E731 - a small space
    a = PlanSpace.build(graph, model, option_filter=keep)
    b = PlanSpace.build(graph, model, option_filter=keep, pp_streams=True)
    g = a.problem.call_names.index("actor_gen")
    from realloc.graph.tail import same_tail

    # a migration's other kv choice follows its row (a hand plan's kv priced as written: test_audit_round13.py)
    other_kv = lambda i: i and b.options[g][i] == b.options[g][i - 1] and same_tail(b.tail_of(g, i),  # noqa: E731
                                                                                    b.tail_of(g, i - 1))
    added = [i for i in range(len(b.options[g])) if b.tail_of(g, i) is not None
             and (b.options[g][i].strategy.pp > 1 or b.tail_of(g, i).micro_batches or other_kv(i))]
    same = [i for i in range(len(b.options[g])) if i not in added]
    assert added and [b.options[g][i] for i in same] == list(a.options[g])
    assert [b.tail_of(g, i) for i in same] == [a.tail_of(g, i) for i in range(len(a.options[g]))]
    assert np.array_equal(b.problem.candidates[g].time[same], a.problem.candidates[g].time)
    assert [b.tails[g][i].tail for i in same if b.tails[g][i]] == [t.tail for t in a.tails[g] if t]


def test_both_simulators_agree_on_random_plans_with_pp2_streams(graph, model):
    keep = lambda c, o: o.mesh.size <= 2 and o.n_mbs <= 2 and o.strategy.tp == 1  # noqa: E731
    space = PlanSpace.build(graph, model, option_filter=keep, pp_streams=True)
    names = space.problem.call_names
    g = names.index("actor_gen")
    pp2 = [i for i in range(len(space.options[g])) if space.tail_of(g, i) is not None
           and space.options[g][i].strategy.pp == 2]
    rng = np.random.default_rng(32)
    n_split = 0
    for _ in range(25):
        idx = np.asarray([int(rng.integers(len(o))) for o in space.options] + [0] * len(space.problem.fused),
                         np.int32)
        idx[g] = pp2[int(rng.integers(len(pp2)))]
        got = space.evaluate(idx)
        assert got == reference.evaluate(space.problem, idx)
        view = TailView(space.problem, idx)
        n_split += sum(view.split(c) is not None for c in view.split_of)
    assert n_split > 5
    # a plan streaming at pp 2 to the consumers off its mesh: at R_t 6 (a grid entry) the plan's entry
    assert tail_rows(32, 0.2) == 6


# -- micro-batch streaming at pp > 1: waves of pp micro-batches, each wave handed on as it ends ------------------------
def _waves_pp2(ctx, gconfig, thresholds, n_mbs):
    from model_helpers import build_model
    from realloc.models.config import get_model_config
    from realloc.models.stream_decode import SplitGeneration
    from test_stream_chunks import split_at
    from test_streaming import _prompts, _responses

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 2, seed=3)
    rows = _prompts()
    plain = _responses(model.generate([r.tolist() for r in rows], gconfig, seq_ids=range(len(rows)), n_mbs=n_mbs))
    return (ctx.rank, plain, *split_at(SplitGeneration(model, rows, gconfig, range(len(rows)), n_mbs, True),
                                       thresholds))


def test_waves_of_a_pp2_generation_split_where_a_wave_ends_and_decode_the_plain_tokens(pool):  # noqa: F811
    """``SplitGeneration(one_by_one=True)`` at pp 2 with 4 micro-batches of 3 rows: two waves of two micro-batches
    stepped through both stages; the split point comes when the first wave's last row ends (whatever the EOS
    schedule), its chunk is that wave's 6 rows, and every token and log-prob is the plain pp 2 generation's."""
    from realloc.estimator.mb_stream_cost import last_rows
    from realloc.graph.tail import split_thresholds
    from realloc.models.sampling import GenerationConfig
    from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE

    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(), temperature=0.9,
                               length_schedule=SCHEDULE)
    thresholds = split_thresholds(N_ROWS, last_rows(N_ROWS, 2), 1)
    results = sorted(pool.run(_waves_pp2, gconfig, thresholds, 4))
    for rank, plain, got, chunks, _ in results:
        assert chunks == [list(range(6))], rank
        for i, (tok, lp) in enumerate(plain):
            assert got[i][0] == tok and torch.equal(got[i][1], lp), (rank, i)


def test_a_micro_batch_entry_at_pp2_counts_waves_and_refuses_other_shapes(graph):
    from realloc.graph.streaming import check_runtime_tail

    pp2 = dict(PP2, actor_gen=("localhost:0-1", 1, 1, 2, 4))
    plan = ExecutionPlan.by_hand(graph, pp2, tail={"actor_gen": TailMigration(rows=16, instances=0, chunks=1,
                                                                             micro_batches=True)})
    check_runtime_tail(plan, graph)
    assert ("tail: actor_gen hands each of its 2 waves of 2 micro-batches to the next calls as it ends (waves one "
            "after another, no migration)") in plan.table(graph.topo_order)
    with pytest.raises(ValueError, match=r"'actor_gen': micro_batches at pp 2 hands on each of the call's 2 waves .* "
                                         r"chunks must be 1 and rows the last wave's 16 of 32"):
        check_runtime_tail(ExecutionPlan.by_hand(graph, pp2, tail={"actor_gen": TailMigration(
            rows=8, instances=0, chunks=3, micro_batches=True)}), graph)
    with pytest.raises(ValueError, match=r"n_mbs must be a multiple of 2 and at least 4 \(got 2\)"):
        check_runtime_tail(_plan(graph, {"actor_gen": TailMigration(rows=16, instances=0, chunks=1,
                                                                      micro_batches=True)}), graph)


def test_a_pp2_generation_handing_on_its_waves_matches_the_unstreamed_run(tmp_path):
    """PPO on four devices: generation at pp 2 on devices 0-1 in 4 micro-batches (two waves of two) hands the first
    wave's 16 rows to the inference calls on device 2 as it ends (``micro_batches=True``); each inference call runs
    on rows 0-15, then 16-31, and samples, metrics and the whole checkpoint (optimizer state included) equal the same
    pp 2 run without the entry."""
    from test_stream_chunks import logged_parts
    from test_streaming import _experiment, _run, assert_same_runs

    exp = _experiment(tmp_path, "ppo")
    exp.write_text(exp.read_text().replace("n_devices_per_node=2", "n_devices_per_node=4"))
    gen = ("localhost:0-1", 1, 1, 2, 4)
    places = dict(infer=("localhost:2", 1, 1, 1, 1), train=("localhost:2-3", 2, 1, 1, 1))
    entry = TailMigration(rows=16, instances=0, chunks=1, micro_batches=True)
    streamed = _run(tmp_path, exp, "waves", {"actor_gen": entry}, gen, **places)
    plain = _run(tmp_path, exp, "plain", {}, gen, **places)
    calls = logged_parts(streamed / "logs" / "worker2.log")
    for c in ("rew_inf", "ref_inf", "critic_inf"):
        assert calls[0, c] == [list(range(16)), list(range(16, 32))], c
    assert_same_runs(streamed, plain)


def test_waves_at_pp2_are_priced_one_stepped_wave_each_and_both_simulators_agree(graph, model):
    """A hand plan at pp 2 with 4 micro-batches handing on its first wave: phase 1 is the call overhead and one
    stepped wave of two micro-batches (by hand, ``stepped_generation``), phase 2 the other wave and the request."""
    pp2 = dict(PP2, actor_gen=("localhost:0-1", 1, 1, 2, 4))
    entry = TailMigration(rows=16, instances=0, chunks=1, micro_batches=True)
    space, idx = estimate_plan(graph, ExecutionPlan.by_hand(graph, pp2, tail={"actor_gen": entry}), model)
    g = space.problem.call_names.index("actor_gen")
    assert space.tail_of(g, int(idx[g])) == entry
    work = model.workload("actor_gen")
    s = S(1, 1, 2)
    timer = model._timer(model.graph.model_config("actor_gen"), model.call_precision("actor_gen"))
    wave = stepped_generation(timer, s, model.links(_mesh(model, "localhost:0-1"), s), 8, 8,
                              work.lengths.slowest_ends(64, 8, 32), 2, 8 + 64)
    assert space.problem.candidates[g].time[int(idx[g])] == pytest.approx(model.hw.call_overhead + wave, rel=1e-12)
    assert space.tails[g][int(idx[g])].tail == pytest.approx(wave + model.hw.call_overhead, rel=1e-12)
    view = TailView(space.problem, idx)
    assert {space.problem.call_names[c] for c in view.split_of if view.split(c) is not None} == {
        "ref_inf", "rew_inf", "critic_inf"}
    assert space.evaluate(idx) == reference.evaluate(space.problem, idx)


def test_the_search_offers_waves_at_pp2_on_pools(graph):
    """On two pools of two devices, a generation candidate at pp 2 with 2 m micro-batches (m in the grid) gets a
    micro-batch row of m waves; one at pp 2 with 2 micro-batches (one wave) gets none."""
    from realloc.api import Pool
    from realloc.cluster import ClusterSpec

    spec = dataclasses.replace(graph.spec, cluster=ClusterSpec.from_pools(
        [Pool("cpu0", "cpu", 2), Pool("cpu1", "cpu", 2)]))
    pools = build_graph(spec)
    keep = lambda c, o: o.mesh.size <= 2 and (c != "actor_gen" or o.strategy == S(1, 1, 2))  # noqa: E731
    space = PlanSpace.build(pools, CostModel(pools), option_filter=keep)
    g = space.problem.call_names.index("actor_gen")
    got = {(space.options[g][i].n_mbs, space.tail_of(g, i)) for i in range(len(space.options[g]))
           if space.tail_of(g, i) is not None and space.tail_of(g, i).micro_batches}
    want = {(m, TailMigration(rows=last_rows(32, m // 2), instances=0, chunks=m // 2 - 1, micro_batches=True))
            for m in {o.n_mbs for o in space.options[g]} if m % 2 == 0 and m // 2 in MB_GRID}
    assert got and got == want


@pytest.mark.parametrize("tail", [None, TailMigration(rows=6, instances=0), TailMigration(rows=6, instances=0,
                                                                                          chunks=2)])
def test_a_pp1_hand_plan_is_estimated_as_before(graph, model, tail):
    """The rows a hand plan's estimate adds (pp > 1 streams, micro-batch rows on one pool) leave a pp-1 plan's
    estimate as the space without them prices it, bit for bit."""
    from realloc.search.candidates import Option

    pp1 = dict(PP2, actor_gen=("localhost:0-1", 2, 1, 1, 2))
    plan = ExecutionPlan.by_hand(graph, pp1, tail={} if tail is None else {"actor_gen": tail})
    space, idx = estimate_plan(graph, plan, model)
    meshes = {c: _mesh(model, p.mesh) for c, p in plan.placements.items()}
    want = {c: Option(meshes[c], p.strategy, p.n_mbs, p.recompute) for c, p in plan.placements.items()}
    before = PlanSpace.build(graph, model, option_filter=lambda c, o: o == want[c], prune_memory=False,
                             offload=False)
    assert space.evaluate(idx) == before.evaluate(before.indices_of(plan))
