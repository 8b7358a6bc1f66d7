"""What the runtime derives from a plan: chains, reallocation nodes, data layouts, start-up groups."""

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.runtime.control.program import RuntimeProgram


@pytest.fixture(scope="module")
def graph():
    return build_graph(load_experiment("experiments/ppo_tiny.py"))


def make_plan(graph, place, offload=None):
    return ExecutionPlan.by_hand(graph, place, offload=offload)


SAME = ("localhost", 2, 1, 1, 1)


def test_one_layout_per_model_needs_no_reallocation(graph):
    prog = RuntimeProgram(graph, make_plan(graph, {c: SAME for c in graph.topo_order}))
    for m in prog.models:
        assert prog.reallocs(m) == ()
    assert prog.home_call("actor") == "actor_train" and prog.home_call("ref") == "ref_inf"
    assert prog.is_trained("actor") and not prog.is_trained("ref") and prog.is_rule("reward")


def test_recomputation_reaches_the_call_layout_and_does_not_change_the_layout(graph):
    plan = make_plan(graph, {c: SAME for c in graph.topo_order})
    place = dict(plan.placements, actor_train=plan.placements["actor_train"].model_copy(update={"recompute": True}))
    prog = RuntimeProgram(graph, plan.model_copy(update={"placements": place}))
    assert prog.calls["actor_train"].recompute and not prog.calls["critic_train"].recompute
    # same layout as without: no reallocation appears
    assert prog.calls["actor_train"].key == prog.calls["actor_gen"].key and prog.reallocs("actor") == ()


def test_reallocations_follow_the_chain_and_wrap_around(graph):
    place = {c: SAME for c in graph.topo_order}
    place["actor_gen"] = ("localhost:0", 1, 1, 1, 1)
    place["ref_inf"] = ("localhost", 1, 2, 1, 1)
    prog = RuntimeProgram(graph, make_plan(graph, place))
    # actor: gen (own layout) | train (home). Before train: gen -> train; at the next iteration: train -> gen.
    r = prog.reallocs("actor")
    assert [(x.src_call, x.dst_call, x.wraps, x.after) for x in r] == [
        ("actor_train", "actor_gen", True, ("actor_train",)),
        ("actor_gen", "actor_train", False, ("actor_gen",))]
    assert prog.reallocs("ref") == ()  # one call, one layout
    assert prog.reallocs("critic") == ()  # inference and training share a layout
    assert prog.home_call("actor") == "actor_train"


def test_data_layouts_match_where_outputs_live(graph):
    place = {c: SAME for c in graph.topo_order}
    place["actor_gen"] = ("localhost", 1, 1, 2, 1)
    place["critic_inf"] = ("localhost", 1, 1, 2, 1)
    prog = RuntimeProgram(graph, make_plan(graph, place))
    assert prog.producer("actor_gen").stages == (0, 1)  # generation leaves results on every stage
    assert prog.producer("critic_inf").stages == (1,)  # a forward pass on the last one
    assert prog.consumer("critic_train").stages == (0,)
    assert prog.producer_of("seq") == "actor_gen" and prog.producer_of("prompts") is None
    # values: produced on device 1 (last stage), needed by critic_train's dp ranks 0 and 1.
    plan = prog.data_plan("values", "critic_train", 32)
    assert [(t.src, t.dsts, t.lo, t.hi) for t in plan.transfers] == [(1, (0,), 0, 16)]


def test_cached_ranges_are_not_sent_again(graph):
    place = {c: SAME for c in graph.topo_order}
    place["actor_gen"] = ("localhost:0", 1, 1, 1, 1)
    prog = RuntimeProgram(graph, make_plan(graph, place))
    cold = prog.data_plan("seq", "critic_inf", 100)
    assert [(t.src, t.dsts, t.lo, t.hi) for t in cold.transfers] == [(0, (1,), 16, 32)]
    warm = prog.data_plan("seq", "critic_train", 100, cached={1: [("seq", 16, 32)]})
    assert warm.transfers == ()


def test_startup_groups_cover_every_cold_data_plan(graph):
    place = {c: ("localhost", 2, 1, 1, 1) for c in graph.topo_order}
    prog = RuntimeProgram(graph, make_plan(graph, place))
    sets = set(prog.startup_rank_sets())
    for r in graph.calls:
        for key in r.input_data:
            if prog.producer_of(key):
                assert set(prog.data_plan(key, r.name, 8).groups) <= sets


def test_unequal_batches_and_bad_plans_are_refused(graph):
    with pytest.raises(ValueError, match="no placement"):
        RuntimeProgram(graph, make_plan(graph, {"actor_gen": SAME}))
