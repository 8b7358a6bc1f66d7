"""Audit of this session's merged features from a new user's side (round 6): in-place reallocations, streamed
multi-turn rollouts, micro-batch streaming across pools, streaming at pp > 1, the staleness order, run.lock and
atomic saves. Each test of a defect failed before its fix; the in-place reallocation tests guard behaviour that held
(a failing release that no node waits for still fails the run), each docstring says which."""

from __future__ import annotations

import asyncio
import time

import pytest

from fake_workers import FakeWorkers
from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.runtime.control.master import Master, RunFailed
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.wire import protocol
from run_helpers import REPO, TINY


@pytest.mark.parametrize("last", [False, True])
def test_a_failing_non_mover_of_an_in_place_realloc_stops_the_run_in_one_line(tmp_path, last):
    """A reallocation from a layout holding the whole actor on both devices (dp 2) into device 1 alone copies in
    place, and device 0 only releases its source: the master does not wait for its reply
    (master_schedule._wait_realloc). When that reply is a failure the run must still stop with it. ``last``: the
    slow failing release is device 0's last request of the run (actor_gen on both devices, everything after it on
    device 1, the failure in the last iteration), so only the background wait can see it."""
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    if last:
        pl = {c: ("localhost:1", 1, 1, 1, 2) for c in graph.topo_order}
        pl["actor_gen"], into, bad_t = ("localhost", 2, 1, 1, 1), "actor_train", 3
    else:
        pl = {c: ("localhost", 2, 1, 1, 2) for c in graph.topo_order}
        pl["actor_gen"], into, bad_t = ("localhost:1", 1, 1, 1, 1), "actor_gen", 1
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, pl))
    r = next(x for x in program.reallocs("actor") if x.dst_call == into)
    assert program.realloc_movers(r) == frozenset()  # in place: nobody moves a byte

    def fails(req, rank):  # in the rank's thread: its later requests wait, as a real worker's do
        if isinstance(req, protocol.Reallocate) and req.dst_call == into and rank == 0 and req.iteration == bad_t:
            time.sleep(0.5 if last else 0.0)
            return "RuntimeError: release failed"
        return ""

    secret = protocol.new_secret()
    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=4,
                    heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs, fails=fails):
        with pytest.raises(RunFailed) as e:
            asyncio.run(asyncio.wait_for(master.run(), 60))
    msg = str(e.value)
    assert "\n" not in msg and "release failed" in msg and "worker 0" in msg, msg
    assert f"(iteration {bad_t + 1})" in msg, msg
    if not last:  # stopped in iteration 2, not after 4
        assert (tmp_path / "metrics.jsonl").read_text().count("\n") <= 2


@pytest.mark.parametrize("rows,chunks,n_mbs,fix", [(8, 5, 4, "set chunks=3, rows=8"),
                                                    (8, 1, 4, "set chunks=3, rows=8"),
                                                    (5, 3, 4, "set chunks=3, rows=8"),
                                                    (8, 1, 1, "give it n_mbs >= 2")])
def test_a_micro_batch_entry_that_misses_the_calls_micro_batches_is_one_line(rows, chunks, n_mbs, fix):
    """A hand-written micro_batches entry whose chunks is not n_mbs - 1, or whose rows is not the last micro-batch's,
    ran its split points elsewhere than its table line and its price said: chunks=5 on 4 micro-batches printed
    'hands each of its 6 micro-batches'; rows=5 of 32 (4 micro-batches of 8) passed split point 1 only as micro-batch
    2 ended and split point 3 never (2 hand-offs, priced as 3); n_mbs 1 streamed nothing. Each is one error now."""
    from realloc.graph.streaming import check_runtime_tail
    from realloc.graph.tail import TailMigration, split_thresholds
    from test_stream_pools import PLACES

    assert split_thresholds(32, 5, 3) == (23, 14, 5)  # vs 24, 16, 8 rows left after micro-batches 1, 2, 3
    spec = load_experiment(str(REPO / "experiments/ppo_tiny_two_kinds.py"))
    graph = build_graph(spec)
    assert spec.n_seqs(graph.call("actor_gen")) == 32
    places = {**PLACES, "actor_gen": ("cpu1", 1, 1, 1, n_mbs)}
    plan = ExecutionPlan.by_hand(graph, places, tail={"actor_gen": TailMigration(
        rows=rows, instances=0, chunks=chunks, micro_batches=True)})
    with pytest.raises(ValueError) as e:
        check_runtime_tail(plan, graph)
    assert "\n" not in str(e.value) and "'actor_gen'" in str(e.value) and fix in str(e.value), e.value
    ok = ExecutionPlan.by_hand(graph, {**places, "actor_gen": ("cpu1", 1, 1, 1, 4)}, tail={"actor_gen": TailMigration(
        rows=8, instances=0, chunks=3, micro_batches=True)})
    check_runtime_tail(ok, graph)


def test_a_cluster_of_pools_of_different_node_sizes_plans_its_transfers(tmp_path):
    """Pools of 1 and 2 devices per node: every cross-pool reallocation and data transfer of a plan with the
    generation on the 2-device pool must plan, move the bytes that the same plan counts with one node size forced
    (the estimator's way), and none of them within a node (the pools are different hosts). Before, the runtime's
    planner refused them ('meshes disagree on devices per node ... pass devices_per_node explicitly'): `realloc
    run` stopped at start-up naming an argument no user can pass, though `realloc show --plan` passed the plan."""
    from realloc.graph.transfer_plan import plan_data_transfer, plan_param_realloc

    exp = tmp_path / "two_sizes.py"
    exp.write_text((REPO / "experiments/ppo_tiny_two_kinds.py").read_text().replace(
        'Pool("cpu1", "cpu-bf16", 1)', 'Pool("cpu1", "cpu", 2)'))
    (tmp_path / "ppo_tiny.py").write_text((REPO / "experiments/ppo_tiny.py").read_text())
    (tmp_path / "data").symlink_to(REPO / "experiments/data")
    spec = load_experiment(str(exp))
    graph = build_graph(spec)
    pl = {c: ("cpu0", 1, 1, 1, 1) for c in graph.topo_order}
    pl["actor_gen"] = ("cpu1", 2, 1, 1, 1)
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, pl))
    cfg = program.model_config("actor")
    reallocs = [r for r in program.reallocs("actor") if not r.snapshot]
    assert len(reallocs) == 2
    for r in reallocs:
        plan = program.realloc_plan(r)
        src, dst = program.calls[r.src_call].layout, program.calls[r.dst_call].layout
        forced = plan_param_realloc(cfg, src, dst, devices_per_node=2)
        assert plan.moved_bytes == forced.moved_bytes > 0 and plan.intra_node_bytes == 0, r
    seq = program.data_plan("seq", "ref_inf", 8)
    assert seq.moved_bytes == 8 * program.batch_size and seq.intra_node_bytes == 0


def test_show_says_when_a_stream_entry_streams_to_nobody(tmp_path, capsys):
    """A stream-only entry on a generation that spans every device (one pool) hands its rows to no call: the run
    splits the generation into more requests and streams nothing, as the plain call prices it. `realloc show --plan`
    said only 'valid' (and `realloc run`'s table 'streams its finished rows to the next calls'); it now says so,
    in one line, and says nothing more of an entry that streams."""
    from realloc.cli import main

    graph = build_graph(load_experiment(TINY))
    both = {c: ("localhost", 2, 1, 1, 1) for c in graph.topo_order}
    apart = {**both, "actor_gen": ("localhost:0", 1, 1, 1, 1), "ref_inf": ("localhost:1", 1, 1, 1, 1)}
    for name, places in (("both", both), ("apart", apart)):
        ExecutionPlan.by_hand(graph, places, tail={"actor_gen": (4, 0)}).save(tmp_path / f"{name}.json")
        assert main(["show", TINY, "--plan", str(tmp_path / f"{name}.json")]) == 0
        out = capsys.readouterr().out.splitlines()
        lines = [x for x in out if x.startswith("stream")]
        if name == "both":
            assert len(lines) == 1 and "actor_gen hands its rows to no call" in lines[0], out
        else:
            assert lines == [], out
