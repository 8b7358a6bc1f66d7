"""The estimator's price of a fused train pair (issue 33, item 3; estimator/fused_cost.py) against the
plain-Python schedule reference (search/fused_reference.py) fed the same per-stage pass times."""

import pytest

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.estimator.fused_cost import price_fused_pair
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.search.fused_reference import RefModel, RefProblem, evaluate


@pytest.fixture(scope="module")
def setup():
    graph = build_graph(load_experiment("experiments/ppo_7b_7b.py"))
    return graph, CostModel(graph)


def one_f_one_b(model: int, pp: int, stage: int, m: int) -> list:
    warm = min(pp - stage - 1, m)
    seq = [(model, 0, i) for i in range(warm)]
    for i in range(m - warm):
        seq += [(model, 0, warm + i), (model, 1, i)]
    return seq + [(model, 1, i) for i in range(m - warm, m)]


@pytest.mark.parametrize("pp,n_mbs,recompute", [(2, 4, False), (4, 4, True), (4, 8, False)])
def test_price_follows_the_schedule(setup, pp, n_mbs, recompute):
    graph, cost = setup
    dp = 16 // (2 * pp)
    places = {n: ("trainer[01-02]", dp, 2, pp, n_mbs) for n in graph.spec.call_names}
    plan = ExecutionPlan.by_hand(graph, places, recompute=["actor_train", "critic_train"] if recompute else [])
    r = price_fused_pair(cost, plan, "actor_train", "critic_train")
    mesh = graph.spec.cluster.mesh("trainer[01-02]")
    models, serial = [], 0.0
    for call in ("actor_train", "critic_train"):
        p = plan.placements[call]
        fwd, bwd, act = cost.train_passes(call, mesh, p.strategy, p.n_mbs, p.recompute)
        models.append(RefModel(pp, n_mbs, fwd, bwd, act))
        serial += cost.call_cost(call, mesh, p.strategy, p.n_mbs, p.recompute).time
    ref = RefProblem(pp, models[0], models[1])
    fused = evaluate(ref, [list(s) for s in r.schedule.order])
    alone = [evaluate(ref, [one_f_one_b(m, pp, ref.place(m, d)[1], n_mbs) for d in range(pp)]) for m in (0, 1)]
    assert fused.valid and fused.makespan == pytest.approx(r.schedule.makespan, rel=1e-9)
    assert [a.makespan for a in alone] == pytest.approx(list(r.schedule.alone), rel=1e-9)
    saving = alone[0].makespan + alone[1].makespan - fused.makespan
    assert r.serial_time == pytest.approx(serial, rel=1e-12)
    assert r.time == pytest.approx(serial - r.n_steps * saving, rel=1e-9)
    assert r.n_steps == graph.call("actor_train").n_minibatches
    # fusion never loses against the serial run (the serial order is one of the search's starts) and
    # never beats its lower bound
    assert r.bound_time <= r.time + 1e-9 and r.time <= r.serial_time + 1e-9
    assert r.speedup > 1.0
    serial_peak = [max(a, b) for a, b in zip(alone[0].device_peak, alone[1].device_peak)]
    want = max(max(0.0, f - s) for f, s in zip(fused.device_peak, serial_peak))
    assert r.extra_activation == pytest.approx(int(want), abs=1)


def test_unfusable_pair_is_one_value_error(setup):
    graph, cost = setup
    places = {n: ("trainer[01-02]", 4, 2, 2, 4) for n in graph.spec.call_names}
    places["critic_train"] = ("trainer[01-02]", 2, 2, 4, 4)
    plan = ExecutionPlan.by_hand(graph, places)
    with pytest.raises(ValueError, match=r"price_fused_pair\('actor_train', 'critic_train'\).*same pp"):
        price_fused_pair(cost, plan, "actor_train", "critic_train")
    with pytest.raises(ValueError, match="not the TRAIN_STEP call"):
        cost.train_passes("ref_inf", graph.spec.cluster.mesh("trainer[01-02]"), plan.placements["ref_inf"].strategy, 4)


def test_search_report_prices_an_eligible_pair_and_names_an_ineligible_one(setup):
    from realloc.search.fused_report import fused_summary

    graph, cost = setup
    places = {n: ("trainer[01-02]", 4, 2, 2, 4) for n in graph.spec.call_names}
    plan = ExecutionPlan.by_hand(graph, places)
    r = price_fused_pair(cost, plan, "actor_train", "critic_train")
    (line,) = fused_summary(graph, cost, plan)
    assert f"{r.serial_time:.3f} s one after the other, {r.time:.3f} s fused ({r.speedup:.2f}x" in line
    places["critic_train"] = ("trainer01", 2, 2, 2, 4)
    (line,) = fused_summary(graph, cost, ExecutionPlan.by_hand(graph, places))
    assert "not eligible in this plan" in line


def test_fused_alternative_is_the_coplaced_plan_simulated_unfused_and_fused(setup):
    from realloc.search.fused_report import fused_alternative, fused_summary
    from realloc.search.fused_space import SEARCH_ITERATIONS
    from realloc.search.timeline import estimate_plan

    graph, cost = setup
    places = {n: ("trainer[01-02]", 4, 2, 2, 4) for n in graph.spec.call_names}
    places["critic_train"] = ("trainer01", 2, 2, 2, 4)
    plan = ExecutionPlan.by_hand(graph, places)
    alt = fused_alternative(graph, cost, plan, "actor_train", "critic_train")
    a, b = alt.plan.placements["actor_train"], alt.plan.placements["critic_train"]
    assert (a.mesh, a.dp, a.tp, a.pp, a.n_mbs) == (b.mesh, b.dp, b.tp, b.pp, b.n_mbs)
    assert alt.plan.fused == (("actor_train", "critic_train"),)
    space, idx = estimate_plan(graph, alt.plan, cost)  # the simulators' fused node (csrc/fused_node.h)
    unfused, idx_u = estimate_plan(graph, alt.plan.model_copy(update={"fused": ()}), cost)
    assert alt.time == pytest.approx(space.evaluate(idx)["time"])
    assert alt.serial_time == pytest.approx(unfused.evaluate(idx_u)["time"])
    # every call on one mesh runs one after the other: fusing saves the pair's price, the schedule search's
    pair = price_fused_pair(cost, alt.plan, "actor_train", "critic_train", iterations=SEARCH_ITERATIONS,
                            memory_iterations=SEARCH_ITERATIONS // 2)
    assert alt.time == pytest.approx(alt.serial_time - (pair.serial_time - pair.time))
    assert alt.time < alt.serial_time  # pp 2: fusion fills bubbles
    lines = fused_summary(graph, cost, plan, estimated_time=123.0)
    assert f"at best {alt.time:.3f} s/iteration ({alt.serial_time:.3f} s unfused there; searched plan 123.000 s)" \
        in lines[1]
