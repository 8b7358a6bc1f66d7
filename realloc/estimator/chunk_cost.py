"""Pricing chunked streaming (issue 31 item 2; a stream-only ``tail`` entry with ``chunks=k``, graph/tail.py;
docs/tail-semantics.md).

The generation hands its finished rows on at k split points, split point j at the step after which at most
``split_thresholds(n, R, k)[j]`` rows run; the last is the one of plain streaming (R rows). It costs:

- the generation: its plain time split at the last split point (``tail_cost.phase1_cost`` to there, the rest by
  ``stream_cost.stream_phase2``; at pp > 1 as the runtime steps the stages, ``pp_stream_cost.py``), plus, per
  split point before the last, one more request: its worker's ``call_overhead`` and the master's
  ``dispatch_latency`` (the request that continues it after the reply);
- a split consumer: a part per chunk and one on the rest. Chunk i (of the n rows' expected order statistics, the
  rows between thresholds i-1 and i) costs ``c_i``, priced as any part (``tail_cost.part_workload``); chunks after
  the first also pay their request and their transfer's. Run on a device that is free, the chunks end at
  max over j of (T_j + c_j + ... + c_k), T_j the time of split point j, so measured from the last split point T_k
  part 1 takes max_j(c_j + ... + c_k - (T_k - T_j)): the work of chunks j.. less the time the consumer had for
  them before the last split point. The simulators price the part-1 node so (``TailSplit.part1_of``), with
  T_k - T_j = lead x share_j: ``lead`` = T_k - T_1 of the producer's candidate and share_j its part after split j
  by decode steps (the expected steps of the split points). Several split consumers of one generation on the same
  devices share that time: each gets 1 / (their number) of it (exact when their chunks cost in proportion;
  consumers on devices of their own get less credit than they could).
"""

from __future__ import annotations

from realloc.calls import InterfaceType
from realloc.cluster import DeviceMesh
from realloc.estimator.cost import CostModel
from realloc.estimator.pp_stream_cost import stream_phase1, stream_rest
from realloc.estimator.tail_cost import TailCost, _local, migration_step, part_workload
from realloc.graph.tail import split_thresholds
from realloc.strategy import ParallelStrategy

# The chunk counts the search offers beside 1 (search/tail_space.py).
CHUNK_GRID = (2, 4)


def _request(cost: CostModel, mesh: DeviceMesh) -> float:
    """One more request of a running call: the master's round trip and the worker's overhead."""
    hw = (cost.at(mesh) if cost.pool_models else cost).hw
    return hw.call_overhead + hw.dispatch_latency


def split_times(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int, rows: int,
                chunks: int) -> tuple[float, ...]:
    """Seconds from the call's start to each of its split points (each earlier split's request included)."""
    n = cost.workload(call).n_seqs
    return tuple(stream_phase1(cost, call, mesh, strategy, n_mbs, th) + j * _request(cost, mesh)
                 for j, th in enumerate(split_thresholds(n, rows, chunks)))


def chunked_generation_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                            rows: int, chunks: int) -> tuple[TailCost, float]:
    """(the generation's phases: phase 1 to the last split point, phase 2 the rest; the lead T_k - T_1)."""
    times = split_times(cost, call, mesh, strategy, n_mbs, rows, chunks)
    raw = stream_phase1(cost, call, mesh, strategy, n_mbs, rows)
    return (TailCost(times[-1], 0.0, stream_rest(cost, call, mesh, strategy, n_mbs, rows, raw), kv_moved=True),
            times[-1] - times[0])


def lead_shares(cost: CostModel, call: str, rows: int, chunks: int, sharing: int) -> tuple[float, ...]:
    """Per split point j before the last: (T_k - T_j) / (T_k - T_1) by expected decode steps, over ``sharing``
    consumers."""
    n = cost.workload(call).n_seqs
    steps = [migration_step(cost, call, th) for th in split_thresholds(n, rows, chunks)]
    span = max(1, steps[-1] - steps[0])
    return tuple((steps[-1] - s) / span / max(1, sharing) for s in steps[:-1])


def chunk_work(cost: CostModel, call: str, producer: str, mesh: DeviceMesh, strategy: ParallelStrategy,
               n_mbs: int, rows: int, chunks: int, running: tuple[int, ...] | None = None) -> tuple[float, ...]:
    """Seconds of consumer ``call`` on each of the k chunks before the last split point (a chunk after the first
    also pays its own request and its transfer's). ``running``: the rows still running at each split point when
    they are not the thresholds (a multi-turn call counts per turn, ``turn_stream_cost.py``)."""
    if cost.graph.call(call).interface_type is InterfaceType.TRAIN_STEP:
        raise ValueError(f"call {call!r} is a train call; it runs once, after the generation ends")
    model, local = _local(cost, mesh)
    gen = model.workload(producer)
    n = gen.n_seqs
    ends = gen.lengths.order_statistics(gen.gen_len, n)
    cuts = (n, *(running or split_thresholds(n, rows, chunks)))
    cfg = model.graph.model_config(call)
    extra = _request(cost, mesh) + model.hw.call_overhead
    out = []
    for i in range(chunks):
        part = tuple(ends[n - cuts[i]:n - cuts[i + 1]])
        if cfg is None or not part:
            work = model.hw.call_overhead if part else 0.0
        else:
            timer = model._timer(cfg, model.call_precision(call))
            work = timer.time(part_workload(model.workload(call), part, n), strategy,
                              model.links(local, strategy), n_mbs).time
        out.append(work + (extra if i and part else 0.0))
    return tuple(out)
