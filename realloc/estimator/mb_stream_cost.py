"""Pricing micro-batch streaming across pools (issue 32; FlexRLHF Fig. 4b, flexrlhf-placement.txt §IV-A2; a
stream-only ``tail`` entry with ``micro_batches=True``, graph/tail.py; docs/heterogeneous.md).

A generation at pp 1 decodes its m micro-batches one after another (``models/generation.py``): micro-batch j's rows
end together when it ends, whatever the response lengths. Handing each micro-batch on as it ends lets the calls
that read it (on another pool: FlexRLHF's inference GPUs) start while the next micro-batch decodes. It is chunked
streaming (``estimator/chunk_cost.py``) whose k = m - 1 split points fall between micro-batches, R the rows of the
last micro-batch: the plan entry is ``TailMigration(rows=R, instances=0, chunks=m-1, micro_batches=True)``,
``split_thresholds(n, R, m-1)`` then counting exactly the rows of the micro-batches after each split point.

With tau = (plain - call_overhead) / m the time of one micro-batch of the plain call (``CostModel.call_cost``):
split point j comes at T_j = call_overhead + j tau + (j - 1) (request), a request being the master's round trip and
the worker's overhead of each split point's reply and continuation. Phase 1 (to the last split point) is T_k, the
rest tau + call_overhead (the last request), the lead T_k - T_1 = (k - 1)(tau + request), and the share of the lead
after split point j (k - j) / (k - 1). A consumer's chunk is n / m rows of the lengths' expected order statistics
taken evenly (every m-th: a micro-batch holds rows of every length; with fixed lengths all are ``gen_len``), priced
as any part (``tail_cost.part_workload``); a chunk after the first also pays its request and its transfer's. The
simulators read these numbers through the arrays of chunked streaming (``TailColumns.lead``, ``TailSplit``), so C++
and Python price them alike.

At pp > 1 the unit is a wave of pp micro-batches (the plain pipelined call keeps pp in flight): the split generation
steps one wave at a time through the stages (``models/stream_decode.py``), so m = n_mbs / pp units, tau the stepped
time of one wave (``pp_stream_cost.stepped_generation``), and the entry ``TailMigration(rows=n / m, instances=0,
chunks=m - 1, micro_batches=True)``.
"""

from __future__ import annotations

from realloc.calls import InterfaceType
from realloc.cluster import DeviceMesh
from realloc.estimator.chunk_cost import _request
from realloc.estimator.cost import CostModel
from realloc.estimator.pp_stream_cost import stepped_generation
from realloc.estimator.tail_cost import TailCost, _local, part_workload
from realloc.strategy import ParallelStrategy

# The micro-batch counts whose generation candidates the search offers with micro-batch streaming
# (search/mb_stream_space.py); each is one more entry of a stream row's grid.
MB_GRID = (2, 3, 4, 5)


def last_rows(n: int, m: int) -> int:
    """R of an entry streaming ``n`` rows in ``m`` micro-batches: the rows still running at the last split point."""
    return n - (m - 1) * (n // m)


def mb_generation_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy,
                       n_mbs: int) -> tuple[TailCost, float]:
    """(the generation's phases: phase 1 to the last split point, phase 2 the last micro-batch; the lead T_k - T_1)
    of a generation streaming its ``n_mbs`` micro-batches one by one."""
    if strategy.pp > 1:
        return _waves_cost(cost, call, mesh, strategy, n_mbs)
    if n_mbs < 2:
        raise ValueError(f"call {call!r}: a generation streams its micro-batches at pp 1 with 2 or more of them "
                         f"(pp={strategy.pp}, n_mbs={n_mbs})")
    model, _ = _local(cost, mesh)
    overhead, req = model.hw.call_overhead, _request(cost, mesh)
    tau = max(0.0, cost.call_cost(call, mesh, strategy, n_mbs).time - overhead) / n_mbs
    return _phases(overhead, req, tau, n_mbs)


def waves(strategy: ParallelStrategy, n_mbs: int) -> int:
    """The units a micro-batch entry hands on: the micro-batches at pp 1, waves of pp of them at pp > 1 (0: n_mbs
    is no multiple of pp, no such entry)."""
    return n_mbs if strategy.pp == 1 else n_mbs // strategy.pp if n_mbs % strategy.pp == 0 else 0


def _waves_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy,
                n_mbs: int) -> tuple[TailCost, float]:
    """``mb_generation_cost`` at pp > 1: the split generation steps one wave of pp micro-batches at a time through
    the stages (models/stream_decode.py), tau the stepped time of one wave (``pp_stream_cost.stepped_generation``)."""
    m = waves(strategy, n_mbs)
    if m < 2:
        raise ValueError(f"call {call!r}: a generation at pp {strategy.pp} streams waves of pp micro-batches, so "
                         f"n_mbs must be a multiple of pp and at least 2 pp (n_mbs={n_mbs})")
    model, local = _local(cost, mesh)
    work = model.workload(call)
    timer = model._timer(model.graph.model_config(call), model.call_precision(call))
    b = work.micro_batch(strategy.dp, n_mbs)
    tau = stepped_generation(timer, strategy, model.links(local, strategy), b, work.prompt_len,
                             work.lengths.slowest_ends(work.gen_len, b, work.n_seqs), strategy.pp,
                             work.prompt_len + work.gen_len, work.scheduled)
    return _phases(model.hw.call_overhead, _request(cost, mesh), tau, m)


def _phases(overhead: float, req: float, tau: float, m: int) -> tuple[TailCost, float]:
    """(phase 1 to the last split point, the last unit; the lead T_k - T_1) of ``m`` units of ``tau`` seconds."""
    k = m - 1
    return TailCost(overhead + k * tau + (k - 1) * req, 0.0, tau + overhead, kv_moved=True), (k - 1) * (tau + req)


def mb_lead_shares(n_mbs: int, sharing: int) -> tuple[float, ...]:
    """Per split point j before the last: (T_k - T_j) / (T_k - T_1), over ``sharing`` consumers."""
    k = n_mbs - 1
    return tuple((k - j) / (k - 1) / max(1, sharing) for j in range(1, k)) if k > 1 else ()


def mb_chunk_work(cost: CostModel, call: str, producer: str, mesh: DeviceMesh, strategy: ParallelStrategy,
                  n_mbs: int, producer_mbs: int) -> tuple[tuple[float, ...], float]:
    """(seconds of consumer ``call`` on each of the producer's first m - 1 micro-batches, on its last), the last
    with the request of its own transfer, as a part 2."""
    if cost.graph.call(call).interface_type is InterfaceType.TRAIN_STEP:
        raise ValueError(f"call {call!r} is a train call; it runs once, after the generation ends")
    model, local = _local(cost, mesh)
    gen = model.workload(producer)
    n, m = gen.n_seqs, producer_mbs
    ends = gen.lengths.order_statistics(gen.gen_len, n)
    cfg = model.graph.model_config(call)
    # a later chunk's request, its transfer's, and (on a cluster of pools) one more message on the pool link
    extra = _request(cost, mesh) + model.hw.call_overhead + cost.graph.spec.cluster.pool_link_latency

    def work(rows: int) -> float:
        part = tuple(sorted(ends[i * n // rows] for i in range(rows)))  # every (n / rows)-th order statistic
        if cfg is None:
            return model.hw.call_overhead
        timer = model._timer(cfg, model.call_precision(call))
        return timer.time(part_workload(model.workload(call), part, n), strategy, model.links(local, strategy),
                          n_mbs).time

    first = work(n // m)
    chunks = (first,) + (first + extra,) * (m - 2)
    return chunks, work(last_rows(n, m)) + model.hw.call_overhead
