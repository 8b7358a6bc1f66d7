"""Bounded staleness (issue 25): the unrolled graph, the plan's checks, and the master running generation ahead.

The master is driven by fake workers (tests/fake_workers.py) that keep each rank's parameter versions as a
real worker does: a train step adds one at home, a snapshot copies the version the schedule names (and the
source ranks check that it is the version they hold), a generation reports the version of the copy it
reads. The run's records then say how stale every iteration's samples were; they must be exactly
min(t, eta) for the 0-based iteration t (generation of t uses the parameters after train step t - 1 - eta,
or the first ones), never more than eta.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest

from fake_workers import FakeWorkers
from realloc.api import AutoConfig, load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.runtime.control.master import Master
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.wire import protocol
from run_helpers import DISJOINT, REPO, TINY

GRPO = str(REPO / "experiments/grpo_tiny.py")
SFT = str(REPO / "experiments/sft_tiny.py")


def _spec(path: str = TINY, max_staleness: int = 2):
    return dataclasses.replace(load_experiment(path), max_staleness=max_staleness)


def test_unrolled_graph_waits_for_the_train_step_eta_iterations_back():
    g = build_graph(_spec(GRPO))
    assert g.stale_calls == {"actor_gen"}
    sync = g.unroll(6)
    assert set(g.unroll(6, staleness=0).edges) == set(sync.edges)
    for eta in (1, 2):
        u = g.unroll(6, staleness=eta)
        for t in range(6):
            gen_parents = {p for p in u.predecessors(("actor_gen", t)) if p[0] == "actor_train"}
            assert gen_parents == ({("actor_train", t - 1 - eta)} if t - 1 - eta >= 0 else set())
            # the train step that replaces version t waits for the generation reading it, eta iterations on
            train_after = {p for p in u.predecessors(("actor_train", t)) if p[0] == "actor_gen"}
            assert train_after == {("actor_gen", t)} | ({("actor_gen", t + eta)} if t + eta < 6 else set())
        # the frozen models and the train step's own chain are as in the synchronous graph
        assert ("actor_train", 0) in u.predecessors(("actor_train", 1))
        assert set(u.predecessors(("ref_inf", 3))) == set(sync.predecessors(("ref_inf", 3)))


def test_staleness_is_checked_against_the_experiment_and_the_graph():
    spec = _spec(GRPO, max_staleness=1)
    g = build_graph(spec)
    plan = ExecutionPlan.by_hand(g, {c: ("localhost:0", 1, 1, 1, 1) for c in spec.call_names}, staleness=2)
    with pytest.raises(ValueError, match=r"staleness 2.*at most 1.*max_staleness=2"):
        validate_plan(plan, g)
    sft = build_graph(_spec(SFT))
    assert sft.staleness_error(0) is None
    assert "needs a GENERATE call of a trained model" in sft.staleness_error(1)
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        AutoConfig("localhost", 8, max_staleness=-1)


def _versions_play(errors: list[str], in_place: bool = False):
    """reply_stats for FakeWorkers: each rank's home version (train steps it ran) and copy version; a
    generation in the train step's layout (``in_place``) reads home."""
    state: dict[int, dict[str, int]] = {}
    lock = threading.Lock()

    def stats(req, rank):
        with lock:
            st = state.setdefault(rank, {"home": 0, "copy": 0})
            if isinstance(req, protocol.Setup):  # a resumed run's parameters have start_iteration train steps
                st["home"] = st["copy"] = req.start_iteration
            if isinstance(req, protocol.RunCall) and req.eval_batch < 0:
                if req.call == "actor_train":
                    st["home"] += 1
                if req.call == "actor_gen" and rank == 0:
                    return {"param_version": float(st["home" if in_place else "copy"])}
            if isinstance(req, protocol.Reallocate) and req.version >= 0:
                # actor_train runs on both devices: every rank is a source of the snapshot
                if st["home"] != req.version:
                    errors.append(f"rank {rank}: snapshot of version {req.version} while home holds {st['home']}")
                st["copy"] = req.version
            return {}
    return stats


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_master_runs_generation_ahead_with_bounded_staleness(tmp_path, eta):
    spec = _spec()
    graph = build_graph(spec)
    plan = ExecutionPlan.by_hand(graph, {c: (m, dp, 1, 1, 1) for c, (m, dp) in DISJOINT.items()}, staleness=eta)
    program = RuntimeProgram(graph, plan)
    # actor_gen has a layout of its own: at eta > 0 it reads a snapshot and the parameters stay at home
    kinds = [(r.src_call, r.dst_call, r.snapshot) for r in program.reallocs("actor")]
    assert kinds == ([("actor_train", "actor_gen", False), ("actor_gen", "actor_train", False)] if eta == 0
                     else [("actor_train", "actor_gen", True)])
    secret, errors, n = protocol.new_secret(), [], 10
    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=n,
                    heartbeat_timeout=600.0)
    assert master.window >= eta + 2
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs,
                     reply_stats=_versions_play(errors), delays={"call": 0.002}):
        asyncio.run(master.run())
    assert errors == []
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(1, n + 1))
    if eta == 0:
        assert all("staleness" not in m for m in metrics)  # the synchronous records are unchanged
        return
    for t, m in enumerate(metrics):
        st = m["staleness"]
        assert st["versions"] == {"actor_gen": max(0, t - eta)}
        assert st["max"] == st["mean"] == min(t, eta) <= eta


def test_a_stop_while_generation_runs_ahead_ends_cleanly_with_a_checkpoint(tmp_path):
    """A train step waits for a generation eta iterations later; a stopping run starts no more iterations,
    so those waits are released and the iterations in flight finish, save and shut down (no hang)."""
    import signal

    from realloc.runtime.control.stop_signals import StopSignals

    spec = _spec()
    graph = build_graph(spec)
    plan = ExecutionPlan.by_hand(graph, {c: (m, dp, 1, 1, 1) for c, (m, dp) in DISJOINT.items()}, staleness=2)
    secret, errors = protocol.new_secret(), []

    def stop_at_2(m: dict) -> None:
        if m["iteration"] == 2:
            master.request_stop(signal.SIGUSR1)

    master = Master(RuntimeProgram(graph, plan), RunConfig.of(spec), RunPaths(tmp_path), "r1", secret,
                    iterations=20, save_every=3, heartbeat_timeout=600.0, on_iteration=stop_at_2,
                    stop_signals=StopSignals(signal.SIGUSR1, warning_lead=60.0))
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs,
                     reply_stats=_versions_play(errors), delays={"call": 0.01}) as workers:
        asyncio.run(asyncio.wait_for(master.run(), 120))
    assert errors == [] and workers.requests[-1] == "shutdown"
    its = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stop = master.stop
    assert stop is not None and [m["iteration"] for m in its] == list(range(1, stop.after_iteration + 1))
    assert 2 <= stop.after_iteration < 20 and all(m["staleness"]["max"] <= 2 for m in its)
    assert stop.checkpoint is not None


def test_generation_in_the_train_layout_reads_home_in_place_in_order(tmp_path):
    """Everything on one device: no snapshot; the train step of iteration s waits for the generation of
    s + eta, which reads the parameters in place, so the versions are still exactly max(0, t - eta)."""
    spec = _spec()
    graph = build_graph(spec)
    plan = ExecutionPlan.by_hand(graph, {c: ("localhost:0", 1, 1, 1, 1) for c in spec.call_names}, staleness=2)
    program = RuntimeProgram(graph, plan)
    assert program.snapshots("actor") == () and program.reallocs("actor") == ()
    secret, errors = protocol.new_secret(), []
    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=8,
                    heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs,
                     reply_stats=_versions_play(errors, in_place=True)):
        asyncio.run(asyncio.wait_for(master.run(), 120))
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness"]["versions"]["actor_gen"] for m in metrics] == [max(0, t - 2) for t in range(8)]


def test_a_resumed_run_generates_its_first_iterations_from_the_resumed_parameters(tmp_path):
    """Resumed at iteration 5 (0-based) with eta = 2: generations 5..7 use version 5 (nothing older exists),
    then t - 2; staleness is never above eta, and the workers start counting at the resumed version."""
    spec = _spec()
    graph = build_graph(spec)
    plan = ExecutionPlan.by_hand(graph, {c: (m, dp, 1, 1, 1) for c, (m, dp) in DISJOINT.items()}, staleness=2)
    secret, errors = protocol.new_secret(), []
    master = Master(RuntimeProgram(graph, plan), RunConfig.of(spec), RunPaths(tmp_path), "r1", secret,
                    iterations=6, start_iteration=5, heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs,
                     reply_stats=_versions_play(errors)):
        asyncio.run(asyncio.wait_for(master.run(), 120))
    assert errors == []
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == list(range(6, 12))
    assert [m["staleness"]["versions"]["actor_gen"] for m in metrics] == [5, 5, 5, 6, 7, 8]
    assert [m["staleness"]["max"] for m in metrics] == [0, 1, 2, 2, 2, 2]
