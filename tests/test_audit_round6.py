"""Audit of this session's merged features from a new user's side (round 6): in-place reallocations, streamed
multi-turn rollouts, micro-batch streaming across pools, streaming at pp > 1, the staleness order, run.lock and
atomic saves. Each test failed before its fix."""

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
from run_helpers import TINY


def test_a_failing_non_mover_of_an_in_place_realloc_stops_the_run_in_one_line(tmp_path):
    """actor_train holds the whole actor on both devices (dp 2); actor_gen runs on device 1 only, so the
    reallocation into it copies in place and device 0 only releases its source: the master does not wait for its
    reply (master_schedule._wait_realloc). When that reply is a failure the run must still stop with it, at once."""
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    pl = {c: ("localhost", 2, 1, 1, 2) for c in graph.topo_order}
    pl["actor_gen"] = ("localhost:1", 1, 1, 1, 1)
    program = RuntimeProgram(graph, ExecutionPlan.by_hand(graph, pl))
    r = next(x for x in program.reallocs("actor") if x.dst_call == "actor_gen")
    assert program.realloc_movers(r) == frozenset()  # in place: nobody moves a byte

    def fails(req, rank):
        ok = not (isinstance(req, protocol.Reallocate) and req.dst_call == "actor_gen" and rank == 0
                  and req.iteration == 1)
        return "" if ok else "RuntimeError: release failed"

    secret = protocol.new_secret()
    master = Master(program, RunConfig.of(spec), RunPaths(tmp_path), "r1", secret, iterations=4,
                    heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    t0 = time.monotonic()
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs, fails=fails):
        with pytest.raises(RunFailed) as e:
            asyncio.run(asyncio.wait_for(master.run(), 60))
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert "\n" not in msg and "release failed" in msg and "worker 0" in msg, msg
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") <= 2  # stopped in iteration 2, not after 4
