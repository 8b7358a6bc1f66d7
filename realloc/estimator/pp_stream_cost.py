"""Pricing a streamed generation at pp > 1 as the runtime runs it (issue 32 / 31 item 2; a stream-only ``tail`` entry
on a call placed with pp > 1; ``models/stream_pipeline.py``; docs/streaming.md, "Streaming at pp > 1").

The plain generation at pp > 1 pipelines its micro-batches in waves of pp (``generation._pipelined``), a stage
learning micro-batch i's tokens of step t while it already runs step t + 1 of earlier ones: one decode round takes
max(m max_k t_k, sum_k t_k + back) (``call_time.decode_round``). A streamed one must know every step's running rows
before the next step (its split point), so ``stream_pipeline.pipelined_step`` runs each step as a whole: every
micro-batch through the stages (stage k on micro-batch i while stage k + 1 is on i - 1), then the step's tokens back
from the last stage, every send waited for. Every micro-batch is in flight from the first step (no waves), so a step
of m micro-batches with ``rows`` running rows each takes

    sum_k t_k + (m - 1) max_k t_k + back                    (``call_time.pipeline_makespan`` plus the tokens' trip)

the prefill (step 0) likewise. With m = pp = 2 and equal stages that is 3t + back against the plain 2t + back. At
dp > 1 the replicas count their running rows in a blocking all-reduce after every step up to the (last) split point
(``worker_stream._to_split``: the asynchronous counts run at pp 1 only). The per-micro-batch host work (the call's
setup, row drops, the KV caches' first touch) is the plain call's. Phase 1 runs to the split point (the step at
which at most R rows run, ``tail_cost.migration_step``), phase 2 the rest and one more request (its call overhead).

At pp 1 every function here returns exactly what ``tail_cost.phase1_cost`` and ``stream_cost.stream_phase2`` do, so
pp-1 plans and estimates are unchanged bit for bit.
"""

from __future__ import annotations

from typing import Sequence

from realloc.cluster import DeviceMesh
from realloc.estimator.call_time import CallCost, CallTimer, decode_segments, pipeline_makespan, sum_over_range
from realloc.estimator.comm import GroupLinks
from realloc.estimator.cost import CostModel
from realloc.estimator.opcount import Phase
from realloc.estimator.stream_cost import stream_phase2
from realloc.estimator.tail_cost import TailCost, _local, migration_step, phase1_cost
from realloc.strategy import ParallelStrategy

# One running-row count of the blocking per-step all-reduce (worker_stream._to_split: one int64).
STEP_COUNT_BYTES = 8


def stepped_generation(timer: CallTimer, strategy: ParallelStrategy, links: GroupLinks, b: int, prompt: int,
                       ends: Sequence[int], n_mbs: int, slots: int, scheduled: bool = False) -> float:
    """Seconds of ``n_mbs`` micro-batches of ``b`` rows (row i stops after ``ends[i]`` tokens, ascending) decoded
    step by step through the stages, all in flight at once (the module docstring); no call overhead, no counts."""
    t = strategy.tp
    host = timer._engine("engine.decode_step", t, b, prompt, default=timer.hw.decode_step_overhead)
    host += timer._schedule(t, b, scheduled)
    back = timer.comm.time("p2p", 2, 16 * b, links.pp_any)
    total = pipeline_makespan(timer._stages(Phase.PREFILL, strategy, links, b, prompt, host=host), n_mbs).time + back
    total += n_mbs * (timer._engine("engine.gen_call", t, b, prompt)
                      + timer.row_drops(strategy, ends, slots, prompt)
                      + timer.kv_alloc(strategy, b, slots, prompt + sum(ends) / len(ends) - 1))
    for first, last, rows in decode_segments(ends):
        r_host = timer._engine("engine.decode_step", t, rows, prompt, default=timer.hw.decode_step_overhead)
        r_host += timer._schedule(t, rows, scheduled)
        r_back = timer.comm.time("p2p", 2, 16 * rows, links.pp_any)

        def step(ctx: int, rows: int = rows, r_host: float = r_host, r_back: float = r_back):
            span = pipeline_makespan(timer._stages(Phase.DECODE, strategy, links, rows, ctx, host=r_host), n_mbs)
            return span + CallCost.of(pp_comm=r_back)

        total += sum_over_range(step, prompt + first, prompt + last, timer.decode_grid).time
    return total


def _pp_parts(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
              rows: int) -> tuple[float, float]:
    """(phase 1 to the split point of ``rows`` running rows, the whole stepped generation) at pp > 1, each with the
    call overhead and the counts to the split point."""
    cut = migration_step(cost, call, rows)
    model, local = _local(cost, mesh)
    key = ("pp-stream", call, local.n_nodes, local.n_devs, strategy, n_mbs, cut)
    got = model._phase1_cache.get(key)
    if got is not None:
        return got
    work = model.workload(call)
    timer = model._timer(model.graph.model_config(call), model.call_precision(call))
    links = model.links(local, strategy)
    b = work.micro_batch(strategy.dp, n_mbs)
    slots = work.prompt_len + work.gen_len
    counts = cut * model.comm.time("all_reduce", strategy.dp, STEP_COUNT_BYTES, links.dp) if strategy.dp > 1 else 0.0
    fixed = model.hw.call_overhead + counts
    ends = tuple(min(e, cut) for e in work.lengths.order_statistics(work.gen_len, b))
    one = stepped_generation(timer, strategy, links, b, work.prompt_len, ends, n_mbs, slots, work.scheduled)
    whole = stepped_generation(timer, strategy, links, b, work.prompt_len,
                               work.lengths.slowest_ends(work.gen_len, b, work.n_seqs), n_mbs, slots, work.scheduled)
    got = model._phase1_cache[key] = (one + fixed, whole + fixed)
    return got


def stream_phase1(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                  rows: int) -> float:
    """Seconds from a streamed generation's start to its split point of ``rows`` running rows (pp 1:
    ``tail_cost.phase1_cost``)."""
    if strategy.pp == 1:
        return phase1_cost(cost, call, mesh, strategy, n_mbs, rows)
    return _pp_parts(cost, call, mesh, strategy, n_mbs, rows)[0]


def stream_rest(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int, rows: int,
                phase1: float) -> float:
    """Seconds after the (last) split point of ``rows`` running rows, ``phase1`` being ``stream_phase1``'s (pp 1:
    ``stream_cost.stream_phase2``): the rest of the stepped generation and the request that continues it."""
    if strategy.pp == 1:
        return stream_phase2(cost, call, mesh, strategy, n_mbs, phase1)
    model, _ = _local(cost, mesh)
    whole = _pp_parts(cost, call, mesh, strategy, n_mbs, rows)[1]
    return max(0.0, whole - phase1) + model.hw.call_overhead


def stream_generation_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                           rows: int) -> TailCost:
    """A generation streaming its finished rows once at most ``rows`` run, at any pp (no migration)."""
    one = stream_phase1(cost, call, mesh, strategy, n_mbs, rows)
    return TailCost(one, 0.0, stream_rest(cost, call, mesh, strategy, n_mbs, rows, one), kv_moved=True)
