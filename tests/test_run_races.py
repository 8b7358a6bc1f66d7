"""Races between a run's replies, made deterministic: the fake workers (tests/fake_workers.py) hold one reply while
they answer every later request, so the master sees the replies in the order that a loaded machine only sometimes
produces. Each case failed before its fix whenever the held reply came last.

CI failed test_audit_round6's ``test_a_failing_non_mover…[True]`` (DID NOT RAISE) once: the run's shutdown was
acknowledged before a failing release that no node waited for had replied, and the run ended as a success. The
master now waits for every such background reply before it shuts down (``Master.run``)."""

from __future__ import annotations

import asyncio
import threading

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
from run_helpers import TINY

ITERS = 3
HOLD = 1.0  # seconds the failing reply is held: far longer than the rest of the run takes to end


def _run_with_a_late_failure(tmp_path, plan: dict, is_late) -> tuple[str, list[str]]:
    """Run ITERS iterations of ppo_tiny on ``plan``; the reply to the request ``is_late(req, rank)`` picks fails
    and comes HOLD s late, after the replies to every later request. Returns the run's error and the requests
    rank 0 received."""
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, plan))
    secret = protocol.new_secret()
    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=ITERS,
                    heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    fails = lambda req, rank: "RuntimeError: late failure" if is_late(req, rank) else ""  # noqa: E731
    held = lambda req, rank: HOLD if is_late(req, rank) else 0.0  # noqa: E731
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs, fails=fails,
                     held=held) as workers:
        with pytest.raises(RunFailed) as e:
            asyncio.run(asyncio.wait_for(master.run(), 60))
    return str(e.value), workers.requests


def test_a_release_that_fails_after_everything_else_replied_still_fails_the_run(tmp_path):
    """actor_gen on both devices, every other call on device 1: the reallocation into actor_train copies in place
    and device 0 only releases its copy, so no node waits for its reply. In the last iteration that reply fails
    after every other reply of the run has come (before the fix: the master shut the workers down and the run
    ended as a success)."""
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    plan = {c: ("localhost:1", 1, 1, 1, 2) for c in graph.topo_order}
    plan["actor_gen"] = ("localhost", 2, 1, 1, 1)
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, plan))
    r = next(x for x in program.reallocs("actor") if x.dst_call == "actor_train")
    assert program.realloc_movers(r) == frozenset() and 0 not in program.calls["actor_train"].ranks

    def is_late(req, rank: int) -> bool:
        return (isinstance(req, protocol.Reallocate) and req.dst_call == "actor_train" and rank == 0
                and req.iteration == ITERS - 1)

    error, requests = _run_with_a_late_failure(tmp_path, plan, is_late)
    assert "\n" not in error and "worker 0" in error and "late failure" in error, error
    assert f"(iteration {ITERS})" in error, error
    assert "shutdown" not in requests  # the run did not end before the reply came


def test_a_data_release_that_fails_after_everything_else_replied_still_fails_the_run(tmp_path):
    """Each reported iteration releases its data on every worker, and nothing waits for those replies. The last
    iteration's release fails after everything else has replied."""
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    plan = {c: ("localhost", 2, 1, 1, 1) for c in graph.topo_order}

    def is_late(req, rank: int) -> bool:
        return isinstance(req, protocol.ReleaseData) and req.before_iteration == ITERS and rank == 1

    error, requests = _run_with_a_late_failure(tmp_path, plan, is_late)
    assert "\n" not in error and "worker 1 failed in release data" in error and "late failure" in error, error
    assert "shutdown" not in requests


class _KilledPeerLauncher:
    """The launcher of a run whose worker 1 was killed in the middle of a collective: it reports the exit once rank 0
    has seen its connection break, which is when a real kill shows to its peer."""

    one_machine = True

    def __init__(self) -> None:
        self.killed = threading.Event()

    def dead(self) -> dict[int, int]:
        return {1: -9} if self.killed.is_set() else {}

    def pid(self, rank: int) -> int:
        return 4242 + rank

    def stop(self, grace: float = 5.0, hung=()) -> None:
        pass

    def wait_exit(self, timeout: float) -> bool:
        return True


def test_a_peer_broken_by_a_killed_worker_names_the_killed_worker(tmp_path):
    """CI failed test_runtime_e2e's killed-worker case once: worker 0's gloo collective reported 'Connection reset
    by peer' before the master noticed worker 1's exit, and the run's one error line named worker 0's echo. A
    failing reply now names another worker that has exited with a failure code, as the cause."""
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, {c: ("localhost", 2, 1, 1, 1)
                                                                  for c in graph.topo_order}))
    launcher = _KilledPeerLauncher()

    def fails(req, rank):
        if isinstance(req, protocol.RunCall) and rank == 0 and req.iteration == 1 and not launcher.killed.is_set():
            launcher.killed.set()
            return "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
        return ""

    secret = protocol.new_secret()
    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=ITERS,
                    heartbeat_timeout=600.0, launcher=launcher)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs, fails=fails):
        with pytest.raises(RunFailed) as e:
            asyncio.run(asyncio.wait_for(master.run(), 60))
    msg = str(e.value)
    # (what it was doing is the fake worker's: it answered on, so "while idle" or its last request)
    assert msg.startswith("worker 1 (pid 4243) exited with code -9 while "), msg
    assert "\n" not in msg and "Connection reset" not in msg, msg
