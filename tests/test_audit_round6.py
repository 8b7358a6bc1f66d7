"""Audit of this session's merged features from a new user's side (round 6): in-place reallocations, streamed
multi-turn rollouts, micro-batch streaming across pools, streaming at pp > 1, the staleness order, run.lock and
atomic saves. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

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
from test_length_schedule import pool  # noqa: F401 - the module's gloo pool


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


def test_micro_batches_that_differ_by_a_row_split_at_each_micro_batch_end(pool):  # noqa: F811 - the gloo pool
    """12 rows in 5 micro-batches one after another (3, 3, 2, 2, 2 rows: the first hold the remainder). Each split
    point must come as its micro-batch ends and hand on exactly its rows, as the plan prices it (4 hand-offs). The
    thresholds interpolated from rows=last_rows(12, 5) (10, 8, 6, 4) passed split points 2 and 3 at once (an
    empty chunk) and split point 1 mid-micro-batch; the runtime now counts the micro-batches' rows
    (graph/tail.mb_split_thresholds, over the dp replicas in worker_stream)."""
    from test_stream_chunks import _chunked
    from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE

    from realloc.graph.tail import mb_split_thresholds
    from realloc.models.sampling import GenerationConfig
    from realloc.strategy import even_ranges

    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(), temperature=0.9,
                               length_schedule=SCHEDULE)
    spans = even_ranges(N_ROWS, 5)
    thresholds = mb_split_thresholds([hi - lo for lo, hi in spans])
    assert thresholds == (9, 6, 4, 2)
    plain, got, chunks, _ = next(r for r in pool.run(_chunked, gconfig, thresholds, 5, True) if r)
    assert chunks == [list(range(lo, hi)) for lo, hi in spans[:-1]]
    for i, (tok, lp) in enumerate(plain):
        assert got[i][0] == tok and torch.equal(got[i][1], lp), i


@pytest.mark.parametrize("chunks,n_mbs,fix", [(5, 4, "set chunks=3"), (1, 4, "set chunks=3"),
                                               (1, 1, "give the call n_mbs >= 2")])
def test_a_micro_batch_entry_whose_chunks_miss_the_calls_micro_batches_is_one_line(chunks, n_mbs, fix):
    """A hand-written micro_batches entry with chunks != n_mbs - 1 ran (its table said 'each of its 6
    micro-batches' of a call of 4; with n_mbs 1 it streamed nothing) and was priced as the call's own count."""
    from realloc.graph.streaming import check_runtime_tail
    from realloc.graph.tail import TailMigration
    from test_stream_pools import PLACES

    spec = load_experiment(str(REPO / "experiments/ppo_tiny_two_kinds.py"))
    graph = build_graph(spec)
    places = {**PLACES, "actor_gen": ("cpu1", 1, 1, 1, n_mbs)}
    plan = ExecutionPlan.by_hand(graph, places, tail={"actor_gen": TailMigration(
        rows=8, instances=0, chunks=chunks, micro_batches=True)})
    with pytest.raises(ValueError) as e:
        check_runtime_tail(plan, graph)
    assert "\n" not in str(e.value) and "'actor_gen'" in str(e.value) and fix in str(e.value), e.value
    ok = ExecutionPlan.by_hand(graph, {**places, "actor_gen": ("cpu1", 1, 1, 1, 4)}, tail={"actor_gen": TailMigration(
        rows=8, instances=0, chunks=3, micro_batches=True)})
    check_runtime_tail(ok, graph)
