"""Fused train pairs in ExecutionPlan (issue 33, item 1): the field, by_hand, JSON, the table, validation."""

import dataclasses
import json

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.fused import fusable_pairs
from realloc.graph.plan import CallPlacement, ExecutionPlan, validate_plan


@pytest.fixture(scope="module")
def graph():
    return build_graph(load_experiment("experiments/ppo_7b_7b.py"))


def plan(graph, fused=(("actor_train", "critic_train"),), **changes) -> ExecutionPlan:
    places = {n: ("trainer[01-02]", 4, 2, 2, 4) for n in graph.spec.call_names}
    places.update(changes)
    return ExecutionPlan.by_hand(graph, places, fused=fused)


def test_fused_pair_validates_round_trips_and_shows(graph, tmp_path):
    p = plan(graph)
    validate_plan(p, graph)
    path = tmp_path / "plan.json"
    p.save(path)
    again = ExecutionPlan.load(path)
    assert again == p and again.fused == (("actor_train", "critic_train"),)
    assert json.loads(path.read_text())["fused"] == [["actor_train", "critic_train"]]
    assert "fused: actor_train + critic_train" in p.table()
    # a plan written before the field existed fuses nothing
    old = json.loads(p.to_json())
    del old["fused"]
    assert ExecutionPlan.from_json(json.dumps(old)).fused == ()


def test_ppo_offers_exactly_the_actor_critic_pair(graph):
    assert fusable_pairs(graph) == [("actor_train", "critic_train")]


@pytest.mark.parametrize("fused,changes,message", [
    ((("actor_train", "ref_inf"),), {}, "call 'ref_inf' is not a TRAIN_STEP call"),
    ((("actor_train", "actor_train"),), {}, "fused with itself"),
    ((("actor_train", "nope"),), {}, "call 'nope' is not in experiment"),
    ((("actor_train", "critic_train"),), {"critic_train": ("trainer01", 2, 2, 2, 4)}, "must run on the same mesh"),
    ((("actor_train", "critic_train"),), {"critic_train": ("trainer[01-02]", 2, 2, 4, 4)}, "same pp"),
    ((("actor_train", "critic_train"), ("critic_train", "actor_train")), {}, "in two fused pairs"),
])
def test_bad_pairs_are_one_value_error(graph, fused, changes, message):
    with pytest.raises(ValueError, match="plan field 'fused'") as e:
        validate_plan(plan(graph, fused, **changes), graph)
    assert message in str(e.value)


def test_dependent_train_calls_cannot_fuse(graph):
    # the same PPO graph with an edge actor_train -> critic_train: the two can no longer overlap
    from realloc.graph.fused import fused_pair_error

    places = {n: CallPlacement(mesh="trainer[01-02]", dp=4, tp=2, pp=2, n_mbs=4) for n in graph.spec.call_names}
    assert fused_pair_error(graph, places, "actor_train", "critic_train") is None
    edged = graph.graph.copy()
    edged.add_edge("actor_train", "critic_train")
    dependent = dataclasses.replace(graph, graph=edged)
    assert "depend on each other" in fused_pair_error(dependent, places, "critic_train", "actor_train")
    assert fusable_pairs(dependent) == []
