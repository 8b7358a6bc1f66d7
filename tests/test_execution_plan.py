"""ExecutionPlan JSON round trip, table and validation against its experiment (issue 2, item 7)."""

import json

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan, validate_plan
from realloc.strategy import ParallelStrategy


@pytest.fixture(scope="module")
def graph():
    return build_graph(load_experiment("experiments/ppo_7b_7b.py"))


def table5_plan(graph, **changes) -> ExecutionPlan:
    """realhf-appendix.txt Table 5: every call on trainer[01-02] with TP8 / PP1 / DP2 and 4 micro-batches."""
    c = graph.spec.cluster
    placements = {n: CallPlacement(mesh="trainer[01-02]", dp=2, tp=8, pp=1, n_mbs=4) for n in graph.spec.call_names}
    placements.update(changes)
    return ExecutionPlan(experiment=graph.spec.name, graph_digest=graph.digest, nodelist=c.nodelist,
                         n_devices_per_node=c.n_devices_per_node, device=c.device, placements=placements,
                         source="heuristic", estimated_time=122.6, call_times={"actor_gen": 44.2})


def test_json_round_trip(graph, tmp_path):
    plan = table5_plan(graph, actor_gen=CallPlacement.of(graph.spec.cluster.mesh("trainer01:0-3"),
                                                         ParallelStrategy(2, 2, 1), 2))
    path = tmp_path / "plan.json"
    plan.save(path)
    again = ExecutionPlan.load(path)
    assert again == plan
    assert again.placements["actor_gen"].strategy == ParallelStrategy(2, 2, 1)
    assert json.loads(path.read_text())["placements"]["actor_gen"]["mesh"] == "trainer01:0-3"
    meshes = validate_plan(again, graph)
    assert meshes["actor_gen"].device_ids == (0, 1, 2, 3)


def test_recompute_round_trips_and_old_plans_without_it_still_load(graph, tmp_path):
    plan = table5_plan(graph, actor_train=CallPlacement(mesh="trainer[01-02]", dp=2, tp=8, pp=1, n_mbs=4,
                                                        recompute=True))
    again = ExecutionPlan.from_json(plan.to_json())
    assert again.placements["actor_train"].recompute and not again.placements["critic_train"].recompute
    # a plan file written before the field existed: every call without recomputation
    old = json.loads(plan.to_json())
    for p in old["placements"].values():
        del p["recompute"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = ExecutionPlan.load(path)
    assert not any(p.recompute for p in loaded.placements.values())
    validate_plan(loaded, graph)
    assert "yes" in next(line for line in plan.table().splitlines() if line.startswith("actor_train"))


def test_recompute_on_a_call_without_backward_is_refused(graph):
    plan = table5_plan(graph, ref_inf=CallPlacement(mesh="trainer[01-02]", dp=2, tp=8, pp=1, n_mbs=4, recompute=True))
    with pytest.raises(ValueError, match="call 'ref_inf': recompute applies to TRAIN_STEP calls only"):
        validate_plan(plan, graph)


def test_table_lists_every_call(graph):
    text = table5_plan(graph).table(graph.topo_order)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["call", "mesh", "dp", "tp", "pp", "mbs"]
    row = next(line for line in lines if line.startswith("actor_gen"))
    assert row.split()[:8] == ["actor_gen", "trainer[01-02]", "2", "8", "1", "4", "-", "44.200"]
    assert "122.600 s" in lines[-1]


def test_unknown_call(graph):
    plan = table5_plan(graph, dpo_train=CallPlacement(mesh="trainer01", dp=8, tp=1, pp=1))
    with pytest.raises(ValueError, match="plan places call 'dpo_train', which experiment 'PPO7Bx7B' does not have"):
        validate_plan(plan, graph)


def test_missing_call(graph):
    plan = table5_plan(graph)
    placements = dict(plan.placements)
    del placements["ref_inf"]
    with pytest.raises(ValueError, match="no placement for call 'ref_inf'"):
        validate_plan(plan.model_copy(update={"placements": placements}), graph)


def test_mesh_outside_cluster(graph):
    plan = table5_plan(graph, rew_inf=CallPlacement(mesh="trainer03", dp=8, tp=1, pp=1))
    with pytest.raises(ValueError, match="call 'rew_inf': mesh 'trainer03' names node 'trainer03', which is not in"):
        validate_plan(plan, graph)


def test_world_size_mismatch(graph):
    plan = table5_plan(graph, rew_inf=CallPlacement(mesh="trainer01", dp=4, tp=4, pp=1))
    with pytest.raises(ValueError, match=r"call 'rew_inf': dp\*tp\*pp = 4\*4\*1 = 16 but mesh 'trainer01' has 8"):
        validate_plan(plan, graph)


def test_strategy_illegal_for_model(graph):
    # tp=16 could hold LLaMA-3-8B's 32 heads (its 8 KV heads replicated twice), but a tp group
    # must stay inside a node (strategy_error; the model's own rule is tests/test_tp_rule.py)
    plan = table5_plan(graph, ref_inf=CallPlacement(mesh="trainer[01-02]", dp=1, tp=16, pp=1))
    with pytest.raises(ValueError, match="call 'ref_inf': tp=16 must divide the 8 devices the mesh uses per node"):
        validate_plan(plan, graph)


def test_micro_batches_must_divide(graph):
    plan = table5_plan(graph, actor_train=CallPlacement(mesh="trainer[01-02]", dp=2, tp=8, pp=1, n_mbs=3))
    with pytest.raises(ValueError, match="call 'actor_train': 64 sequences per step cannot be split over dp=2 into "
                                         "n_mbs=3"):
        validate_plan(plan, graph)


def test_other_experiment_or_cluster(graph):
    other = build_graph(load_experiment("experiments/ppo_7b_34b.py"))
    with pytest.raises(ValueError, match="plan is for cluster 'trainer\\[01-02\\]'"):
        validate_plan(table5_plan(graph), other)
    stale = table5_plan(graph).model_copy(update={"graph_digest": "0" * 16})
    with pytest.raises(ValueError, match="different version of experiment"):
        validate_plan(stale, graph)


def test_bad_json_names_the_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"experiment": "x", "graph_digest": "y", "nodelist": "a", "n_devices_per_node": 8,
                                "device": "cpu", "placements": {"a": {"mesh": "a", "dp": 0, "tp": 1, "pp": 1}}}))
    with pytest.raises(ValueError, match=r"bad.json: field 'placements.a.dp'"):
        ExecutionPlan.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        ExecutionPlan.load(tmp_path / "none.json")


@pytest.mark.parametrize("content", [b"{not json", b'{"format_version": 1, "experi', b"\xff\xfe\x00", b""])
def test_a_file_that_is_no_plan_is_one_error_naming_it(tmp_path, content):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"plan.json: not a plan file \(.*\); write it with `realloc search --out`"):
        ExecutionPlan.load(path)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_rule_calls_are_data_parallel_only(tp, pp):
    """A hand-written plan giving the parameter-free rule reward tp or pp > 1 is refused when validated,
    not with an IndexError in a worker at iteration 1."""
    g = build_graph(load_experiment("experiments/ppo_tiny.py"))
    placements = {c: CallPlacement(mesh="localhost", dp=2, tp=1, pp=1, n_mbs=1) for c in g.topo_order}
    plan = ExecutionPlan(experiment=g.spec.name, graph_digest=g.digest, nodelist="localhost", n_devices_per_node=2,
                         device="cpu", placements=placements)
    validate_plan(plan, g)
    placements["rew_inf"] = CallPlacement(mesh="localhost", dp=1, tp=tp, pp=pp, n_mbs=1)
    with pytest.raises(ValueError, match="call 'rew_inf' runs a rule function, which is data-parallel only"):
        validate_plan(plan.model_copy(update={"placements": placements}), g)


def test_the_readmes_plan_file_and_by_hand_examples_are_valid(tmp_path, monkeypatch):
    """docs/search.md (Planning): the plan-file example parses, its meshes and placements pass the runtime's checks, and
    the ExecutionPlan.by_hand example runs as written (issue 22 item 20)."""
    import re
    from pathlib import Path

    from realloc.graph.plan import check_placement
    from realloc.overrides import load_with_overrides

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "docs/search.md").read_text()
    section = readme[readme.index("**Plan files and hand-written plans.**"):readme.index("Searching from Python:")]
    text = re.search(r"```json\n(.*?)```", section, re.S).group(1)
    plan = ExecutionPlan.from_json(text)
    graph = build_graph(load_with_overrides(str(repo / "experiments/ppo_tiny.py"), []))
    assert plan.graph_digest == graph.digest and plan.experiment == graph.spec.name
    for call, p in plan.placements.items():
        check_placement(graph, call, graph.spec.cluster.mesh(p.mesh), p.strategy, p.n_mbs, p.recompute)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(code.replace('"experiments/ppo_tiny.py"', repr(str(repo / "experiments/ppo_tiny.py"))), {})
    assert ExecutionPlan.load(tmp_path / "plan.json").placements["actor_train"].recompute
