"""The master's side of a fused pair (runtime/control/master_fused.py), driven by fake workers
(tests/fake_workers.py): each iteration sends actor_train and critic_train as one request, after both calls'
producers finished, with the schedule's order of passes for every stage group, and files each call's stats
from the one reply under its own name."""

from __future__ import annotations

import asyncio
import json

import pytest

from fake_workers import FakeWorkers
from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.runtime.control.master import Master
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.wire import protocol
from run_helpers import TINY

ITERS = 3
PAIR = ("actor_train", "critic_train")


def test_the_pair_is_one_request_after_both_calls_inputs(tmp_path):
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    pl = {c: ("localhost", 2, 1, 1, 1) if graph.model_config(c) is None else ("localhost", 1, 1, 2, 4)
          for c in graph.topo_order}
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, pl, fused=[PAIR]))
    # the critic's stages run in reverse order on the pair's mesh, in all its calls there; the actor's do not
    assert [program.calls[c].ranks for c in ("critic_inf", "critic_train", "actor_train")] == [(1, 0), (1, 0), (0, 1)]
    secret = protocol.new_secret()
    seen: list[protocol.RunCall] = []

    def reply_stats(req, rank):
        if not (isinstance(req, protocol.RunCall) and req.fused_with):
            return {}
        seen.append(req)
        return {"actor_loss": 1.0, protocol.FUSED_SECOND_STATS + "critic_loss": 2.0} if rank == 1 else {}

    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=ITERS,
                    heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs,
                     reply_stats=reply_stats):
        asyncio.run(master.run())

    assert len(seen) == 2 * ITERS and {(r.call, r.fused_with) for r in seen} == {PAIR}
    for r in seen:  # per stage group, every pass of both calls: 4 micro-batches, forward and backward each
        assert len(r.fused_order) == 2 and all(sorted(map(tuple, st)) == sorted(
            (m, b, i) for m in (0, 1) for b in (0, 1) for i in range(4)) for st in r.fused_order)
    requests = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    for t in range(1, ITERS + 1):
        calls = {r["label"]: r for r in requests if r["kind"] == "call" and r["iteration"] == t}
        assert "+".join(PAIR) in calls and not set(PAIR) & set(calls)
        fused = calls["+".join(PAIR)]
        producers = {u for c in PAIR for u in graph.graph.predecessors(c)}
        assert all(calls[u]["completed"] <= fused["dispatched"] for u in producers)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["calls"]["actor_train"] for m in metrics] == [{"actor_loss": 1.0}] * ITERS
    assert [m["calls"]["critic_train"] for m in metrics] == [{"critic_loss": 2.0}] * ITERS
    # the pair's time is booked to both calls, each its estimated time's share (the second's own node is empty)
    from realloc.estimator.cost import CostModel

    cost = CostModel(graph)
    est = [cost.call_cost(c, cost.cluster.mesh("localhost"), program.plan.placements[c].strategy, 4).time
           for c in PAIR]
    for m in metrics:
        a, c = (m["time"][k] for k in PAIR)
        assert c > 0 and abs(a / (a + c) - est[0] / sum(est)) < 0.02


def test_a_fused_plan_on_gpus_gets_every_stage_groups_order():
    """NCCL runs fused pairs (tests/test_fused_rendezvous.py): the master orders a GPU plan's pair as a CPU plan's."""
    from realloc.models.fused_protocol import build_programs
    from realloc.runtime.control.master_fused import fused_orders
    from run_helpers import REPO

    graph = build_graph(load_experiment(str(REPO / "experiments/ppo_7b_7b.py")))
    plan = ExecutionPlan.by_hand(graph, {n: ("trainer[01-02]", 4, 2, 2, 4) for n in graph.spec.call_names},
                                 fused=[PAIR])
    orders = fused_orders(graph, plan)[PAIR]
    every = sorted((m, bw, mb) for m in (0, 1) for bw in (0, 1) for mb in range(4))
    assert len(orders) == 2 and all(sorted(map(tuple, group)) == every for group in orders)
    assert len(build_programs(orders)) == 2
