"""Leftovers of issue 32's fifth round: a tail entry's counts refuse a bool (JSON ``true`` used to read as 1); the
estimator prices a reallocation or data transfer between pools on the plan the runtime makes (each mesh with its own
pool's node size), not on one made with the receiver's node size for both ends."""

from __future__ import annotations

import dataclasses
import json

import pytest

from realloc.api import Pool, load_experiment
from realloc.cluster import ClusterSpec
from realloc.estimator.cost import DATA_BYTES_PER_TOKEN, CostModel
from realloc.estimator.pool_link import pooled_plan_seconds
from realloc.cli import EXIT_USAGE, main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.graph.tail import TailMigration
from realloc.graph.transfer_plan import DataLayout, Layout, plan_data_transfer, plan_param_realloc
from realloc.strategy import ParallelStrategy

PPO = "experiments/ppo_7b_7b.py"


@pytest.mark.parametrize("field", ["rows", "instances", "chunks"])
def test_a_tail_count_given_as_a_bool_is_one_line_naming_the_field(tmp_path, capsys, field):
    graph = build_graph(load_experiment(PPO))
    places = {c: ("trainer[01-02]", 8, 2, 1, 4) for c in graph.spec.call_names}
    good = tmp_path / "good.json"
    ExecutionPlan.by_hand(graph, places, tail={"actor_gen": {"rows": 100, "instances": 0, "chunks": 2}}).save(good)
    assert main(["show", PPO, "--plan", str(good)]) == 0  # the same entry with numbers is fine
    capsys.readouterr()
    body = json.loads(good.read_text())
    body["tail"]["actor_gen"][field] = True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(body))
    assert main(["show", PPO, "--plan", str(bad)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"field 'tail.actor_gen.{field}'" in err and "not true/false" in err
    with pytest.raises(ValueError, match=f"field 'tail.actor_gen.{field}'.*not true/false"):
        ExecutionPlan.by_hand(graph, places, tail={"actor_gen": {"rows": 100, "instances": 0, field: False}})
    assert TailMigration(rows=3, instances=0).rows == 3


# Three A100 nodes of 4 (devices 0-11) beside one H100 node of 8 (12-19): with the H100s' node size for both ends,
# A100 devices 8-11 and H100 devices 12-15 would count as one node, and the plan would take its sources there.
POOLS = [Pool("a[01-03]", "a100-80g", 4), Pool("h01", "h100-80g", 8)]


@pytest.fixture(scope="module")
def cross():
    spec = dataclasses.replace(load_experiment(PPO), cluster=ClusterSpec.from_pools(POOLS))
    graph = build_graph(spec)
    cost = CostModel(graph)
    meshes = {m.name: m for m in spec.cluster.device_meshes()}
    return spec, graph, cost, meshes


def runtime_seconds(spec, cost, plan, dst_mesh) -> float:
    """The runtime's own plan (``RuntimeProgram.realloc_plan``/``data_plan``: no node size given) on the pool
    link, plus the receiver's request."""
    return (pooled_plan_seconds(plan, spec.cluster, [p.comm for p in cost.pool_models])
            + cost.at(dst_mesh).hw.call_overhead)


@pytest.mark.parametrize("src,dst", [(("a[01-03]", (3, 4, 1)), ("h01", (1, 8, 1))),
                                     (("a[01-03]", (3, 4, 1)), ("h01", (2, 4, 1))),
                                     (("h01", (1, 8, 1)), ("a[01-03]", (3, 4, 1)))])
def test_a_reallocation_between_pools_is_priced_on_the_runtimes_plan(cross, src, dst):
    spec, graph, cost, meshes = cross
    a = (meshes[src[0]], ParallelStrategy(*src[1]))
    b = (meshes[dst[0]], ParallelStrategy(*dst[1]))
    cfg = cost.model_config_of("actor")
    plan = plan_param_realloc(cfg, Layout(*a), Layout(*b), bytes_per_element=cost.at(a[0]).precision.param)
    assert cost.realloc_cost("actor", a, b) == pytest.approx(runtime_seconds(spec, cost, plan, b[0]), rel=1e-12)


def test_a_data_transfer_between_pools_is_priced_on_the_runtimes_plan(cross):
    spec, graph, cost, meshes = cross
    a = (meshes["a[01-03]"], ParallelStrategy(3, 1, 4))  # a generation's outputs on every stage, on three nodes
    b = (meshes["h01"], ParallelStrategy(8, 1, 1))
    n = spec.n_seqs(graph.call("actor_gen"))
    row = spec.seq_len * DATA_BYTES_PER_TOKEN
    want = 0.0
    for key in cost.transferred_keys("actor_gen", "ref_inf"):
        plan = plan_data_transfer({key: [row] * n}, DataLayout(*a, stages=(0, 1, 2, 3)), DataLayout(*b, stages=(0,)))
        want += runtime_seconds(spec, cost, plan, b[0])
    assert cost.data_transfer_cost("actor_gen", "ref_inf", a, b) == pytest.approx(want, rel=1e-12)
