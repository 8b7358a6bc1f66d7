"""Long-tail migration in ExecutionPlan (issue 31, item 3): the field, by_hand, JSON, the table, validation."""

import json

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.tail import TailMigration


@pytest.fixture(scope="module")
def graph():
    return build_graph(load_experiment("experiments/ppo_7b_7b.py"))


def plan(graph, tail) -> ExecutionPlan:
    places = {n: ("trainer[01-02]", 4, 2, 2, 4) for n in graph.spec.call_names}
    return ExecutionPlan.by_hand(graph, places, tail=tail)


def test_tail_validates_round_trips_and_shows(graph, tmp_path):
    p = plan(graph, {"actor_gen": (100, 1)})
    validate_plan(p, graph)
    path = tmp_path / "plan.json"
    p.save(path)
    again = ExecutionPlan.load(path)
    assert again == p and again.tail == {"actor_gen": TailMigration(rows=100, instances=1)}
    assert json.loads(path.read_text())["tail"] == {"actor_gen": {"rows": 100, "instances": 1}}
    assert "tail: actor_gen moves its last 100 running rows to 1 dp replica(s)" in p.table()
    old = json.loads(p.to_json())
    del old["tail"]
    assert ExecutionPlan.from_json(json.dumps(old)).tail == {}  # written before the field: no migration


@pytest.mark.parametrize("tail, message", [
    ({"actor_train": (10, 1)}, "only GENERATE calls"),
    ({"actor_gen": (10, 4)}, "at most 3 of them"),
    ({"actor_gen": (10 ** 6, 1)}, "must be below that"),
    ({"nope": (10, 1)}, "is not in experiment"),
])
def test_bad_tails_are_one_value_error(graph, tail, message):
    with pytest.raises(ValueError, match=message) as e:
        validate_plan(plan(graph, tail), graph)
    assert "plan field 'tail' entry" in str(e.value)


def test_bad_tail_numbers_are_refused_at_load(graph):
    text = json.loads(plan(graph, {}).to_json())
    text["tail"] = {"actor_gen": {"rows": 0, "instances": 1}}
    with pytest.raises(ValueError, match="tail.actor_gen.rows"):
        ExecutionPlan.from_json(json.dumps(text))
