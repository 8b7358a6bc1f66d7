"""Pricing long-tail migration (issue 31 item 3; rlhfuse.txt §4, inter-stage fusion; docs/long-tail.md).

A generation call of n rows with a tail migration (R_t rows, m dp replicas; ``graph/tail.py``) costs, on its
layout (single-stage meshes only):

- phase 1: every dp replica decodes its own rows until the migration point, the step at which R_t rows are
  left: the (n - R_t)-th of the n rows' expected order statistics (``ResponseLengths.order_statistics``); after
  each step the replicas sum their unfinished rows, in an asynchronous all-reduce that runs while they decode the
  next step (``worker_tail.AsyncCounts``), so phase 1 pays for one of them: the last, whose count the replicas
  wait for before they know the migration point;
- migration: the replicas agree that the counts are over (one more small all-reduce), learn each other's row
  counts and prompt width (two more), and all-gather the rows (each replica's share of the call's rows: inputs,
  prompt, tokens and log-probs so far, ``worker_tail._row_table``); then the tail rows get their KV caches on m
  replicas, ceil(R_t / m) rows each, one of two ways (``TailMigration.kv``): by a prefill over prompt + the tokens
  generated so far, or moved from the replicas that hold them (``kv_move_cost.py``); "auto" takes the cheaper;
- phase 2: the replica that holds the longest row decodes from the migration point to that row's end, with every
  m-th of the R_t longest expected lengths (the longest among them), as ``CallTimer.generate_varied`` prices
  decode steps over the rows still running.

A consumer that runs in two parts prices part 1 on the n - R_t shortest expected lengths and part 2 on the R_t
longest, each packed as the estimator packs any call's rows (``memory.Workload.packed``), each a request of its
own (its call overhead); part 2 also pays for the request of its own data transfer (the plain call's one transfer
becomes two).
"""

from __future__ import annotations

import dataclasses
import math

from realloc.calls import InterfaceType
from realloc.cluster import DeviceMesh
from realloc.estimator.call_time import CallTimer, decode_round, decode_segments, pipeline_makespan, sum_over_range
from realloc.estimator.cost import CostModel
from realloc.estimator.kv_move_cost import MOVE_ROW_BYTES, kv_move_seconds
from realloc.estimator.memory import Workload
from realloc.estimator.opcount import Phase
from realloc.estimator.stream_cost import stream_phase2
from realloc.lengths import ResponseLengths
from realloc.strategy import ParallelStrategy

# R_t as a share of the call's rows (rlhfuse.txt Fig. 9: the best is about 20%).
TAIL_GRID = (0.05, 0.10, 0.20, 0.30, 0.40)
# One reduction of phase 1's counts: [unfinished rows, done marker] as int64 (worker_tail.AsyncCounts).
COUNT_BYTES = 16


@dataclasses.dataclass(frozen=True)
class TailCost:
    """Seconds of a migrating generation call's three parts (``time`` of the plan = phase1 + tail)."""

    phase1: float
    migration: float
    phase2: float
    kv_moved: bool  # the migration moves KV caches (else it re-runs prefill; stream-only entries move nothing)

    @property
    def tail(self) -> float:
        return self.migration + self.phase2

    @property
    def total(self) -> float:
        return self.phase1 + self.tail


def tail_rows(n_rows: int, share: float) -> int:
    """R_t for a grid share of ``n_rows`` rows: at least 1, below ``n_rows``."""
    return min(n_rows - 1, max(1, math.floor(n_rows * share + 0.5)))


def split_ends(lengths: ResponseLengths, gen_len: int, n_rows: int, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The expected lengths of the n - R_t rows finished at the migration point and of the R_t tail rows."""
    ends = lengths.order_statistics(gen_len, n_rows)
    return ends[:n_rows - rows], ends[n_rows - rows:]


def part_workload(work: Workload, part_ends: tuple[int, ...], n_rows: int) -> Workload:
    """A consumer's workload on the rows with expected lengths ``part_ends`` (of the generation's ``n_rows``)."""
    n = max(1, math.floor(work.n_seqs * len(part_ends) / n_rows + 0.5))
    return dataclasses.replace(work, n_seqs=n, lengths=ResponseLengths.empirical(part_ends))


def _decode_from(timer: CallTimer, strategy: ParallelStrategy, links, prompt: int, ends: tuple[int, ...],
                 start: int, work: Workload | None = None) -> float:
    """Decode steps start + 1 .. max(ends) - 1 of one micro-batch whose row i stops after ``ends[i]`` tokens
    (with ``work``, the generation's: the rows' cache copies as they finish, and its length schedule's draws)."""
    total = 0.0
    if work is not None:
        total += timer.row_drops(strategy, [e for e in ends if e > start] or [start],
                                 work.prompt_len + work.gen_len, work.prompt_len)
    for first, last, rows in decode_segments(sorted(ends)):
        first = max(first, start + 1)
        if first > last:
            continue
        host = timer._engine("engine.decode_step", strategy.tp, rows, prompt, default=timer.hw.decode_step_overhead)
        host += timer._schedule(strategy.tp, rows, work is not None and work.scheduled)

        def step(ctx: int, rows: int = rows, host: float = host):
            return decode_round(timer._stages(Phase.DECODE, strategy, links, rows, ctx, host=host), 1, 0.0)

        total += sum_over_range(step, prompt + first, prompt + last, timer.decode_grid).time
    return total


def _local(cost: CostModel, mesh: DeviceMesh) -> tuple[CostModel, DeviceMesh]:
    """The model that prices ``mesh`` and the mesh in its terms (a cluster of pools prices per pool)."""
    return (cost.at(mesh), mesh.in_pool) if cost.pool_models else (cost, mesh)


def migration_step(cost: CostModel, call: str, rows: int) -> int:
    """The decode step at which no more than ``rows`` rows of ``call`` are running: the (n - R_t)-th order
    statistic of its n rows' expected lengths."""
    work = cost.workload(call)
    n = work.n_seqs
    if not 1 <= rows < n:
        raise ValueError(f"call {call!r}: the tail must be 1 .. {n - 1} rows, got {rows}")
    return work.lengths.order_statistics(work.gen_len, n)[n - rows - 1]


def phase1_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                rows: int) -> float:
    """Seconds of phase 1: every replica decodes its rows up to the migration step (and the call's dispatch)."""
    cut = migration_step(cost, call, rows)
    model, mesh = _local(cost, mesh)
    # rows enter only through the step they cut at, so thresholds with one step share a price (the search asks
    # for every candidate's split points, chunk_cost.split_times: the same few shapes many times); a cluster of
    # pools keeps the prices in each pool's model
    key = (call, mesh.n_nodes, mesh.n_devs, strategy, n_mbs, cut)
    got = model._phase1_cache.get(key)
    if got is not None:
        return got
    work = model.workload(call)
    timer = model._timer(model.graph.model_config(call), model.call_precision(call))
    b = work.micro_batch(strategy.dp, n_mbs)
    ends = tuple(min(e, cut) for e in work.lengths.order_statistics(work.gen_len, b))
    links = model.links(mesh, strategy)
    counts = model.comm.time("all_reduce", strategy.dp, COUNT_BYTES, links.dp)  # the last count's reduction
    got = model._phase1_cache[key] = (timer.generate_varied(strategy, links, b, work.prompt_len, ends, n_mbs,
                                                            slots=work.prompt_len + work.gen_len,
                                                            scheduled=work.scheduled).time
                                      + model.hw.call_overhead + counts)
    return got


def row_bytes(prompt_len: int, gen_len: int) -> int:
    """Bytes of one row in the migration's all-gather (``worker_tail._row_table``): the call's input (a prompt of
    int64 tokens, its length and dataset row), the prompt again, int64 tokens and float32 log-probs for every
    possible new token, id, prompt and response lengths (int64), the EOS and tail flags (one byte each)."""
    return 8 * prompt_len * 2 + 12 * gen_len + 5 * 8 + 2


def migration_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, rows: int,
                   instances: int, moved: bool = False) -> float:
    """Seconds from the migration point until the tail replicas start their prefill (or their caches move): the
    counts' closing reduction, the row counts' all-gather and the prompt width's all-reduce, then the rows'
    all-gather, in which every replica sends its share of the call's rows (a tail replica sends them all)."""
    model, mesh = _local(cost, mesh)
    work = model.workload(call)
    links = model.links(mesh, strategy)
    small = 3 * model.comm.time("all_reduce", strategy.dp, COUNT_BYTES, links.dp)
    share = -(-work.n_seqs // strategy.dp)
    width = row_bytes(work.prompt_len, work.gen_len) + (MOVE_ROW_BYTES if moved else 0)
    return small + model.comm.time("all_gather", strategy.dp, share * width, links.dp)


def tail_phase_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, rows: int,
                    instances: int, kv: str = "auto") -> tuple[float, float, bool]:
    """(migration, phase 2, whether the KV caches move) of a tail of ``rows`` rows on ``instances`` replicas; ``kv``
    as ``TailMigration.kv`` ("auto": the cheaper of the move and the re-run prefill)."""
    if strategy.pp != 1 or not 1 <= instances < strategy.dp:
        raise ValueError(f"call {call!r}: a tail migrates within a single-stage mesh to 1 .. dp - 1 replicas "
                         f"(pp={strategy.pp}, dp={strategy.dp}, instances={instances})")
    cut = migration_step(cost, call, rows)
    model, mesh = _local(cost, mesh)
    work = model.workload(call)
    cfg = model.graph.model_config(call)
    timer = model._timer(cfg, model.call_precision(call))
    links = model.links(mesh, strategy)
    prompt = work.prompt_len
    _, tail = split_ends(work.lengths, work.gen_len, work.n_seqs, rows)
    per = -(-rows // instances)
    held = tail[::-1][::instances][::-1]  # the replica with the longest row: every m-th from the top
    host = timer._engine("engine.decode_step", strategy.tp, per, prompt + cut, default=timer.hw.decode_step_overhead)
    prefill = pipeline_makespan(timer._stages(Phase.PREFILL, strategy, links, per, prompt + cut, host=host), 1).time
    prefill += timer.kv_alloc(strategy, per, prompt + work.gen_len,  # the tail's new caches (tail_decode.py)
                              prompt + sum(held) / len(held) - 1)
    touched = prompt + sum(held) / len(held) - 1
    by_prefill = migration_cost(cost, call, mesh, strategy, rows, instances) + prefill
    by_move = migration_cost(cost, call, mesh, strategy, rows, instances, moved=True) + kv_move_seconds(
        timer, model.comm, links.dp, cfg, strategy, model.call_precision(call), per, prompt, cut,
        prompt + work.gen_len, touched)
    moved = kv == "move" or (kv == "auto" and by_move <= by_prefill)
    return by_move if moved else by_prefill, _decode_from(timer, strategy, links, prompt, held, cut, work), moved


def tail_generation_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                         rows: int, instances: int, kv: str = "auto") -> TailCost:
    """A generation call's phases with a tail migration of ``rows`` rows to ``instances`` dp replicas (0: stream
    only, ``stream_cost.py``)."""
    if instances == 0:
        one = phase1_cost(cost, call, mesh, strategy, n_mbs, rows)
        return TailCost(one, 0.0, stream_phase2(cost, call, mesh, strategy, n_mbs, one), kv_moved=True)
    migration, phase2, moved = tail_phase_cost(cost, call, mesh, strategy, rows, instances, kv)
    return TailCost(phase1=phase1_cost(cost, call, mesh, strategy, n_mbs, rows), migration=migration,
                    phase2=phase2, kv_moved=moved)


def consumer_parts(cost: CostModel, call: str, producer: str, mesh: DeviceMesh, strategy: ParallelStrategy,
                   n_mbs: int, rows: int) -> tuple[float, float]:
    """(part 1, part 2) seconds of consumer ``call`` when ``producer`` migrates a tail of ``rows`` rows."""
    rpc = cost.graph.call(call)
    cost, mesh = _local(cost, mesh)
    if rpc.interface_type is InterfaceType.TRAIN_STEP:
        raise ValueError(f"call {call!r} is a train call; it runs once, after the generation ends")
    gen = cost.workload(producer)
    short, tail = split_ends(gen.lengths, gen.gen_len, gen.n_seqs, rows)
    cfg = cost.graph.model_config(call)
    if cfg is None:
        return cost.hw.call_overhead, 2 * cost.hw.call_overhead  # a rule: its requests (part 2: and its transfer)
    timer = cost._timer(cfg, cost.call_precision(call))
    links = cost.links(mesh, strategy)
    work = cost.workload(call)
    part1, part2 = (timer.time(part_workload(work, ends, gen.n_seqs), strategy, links, n_mbs).time
                    for ends in (short, tail))
    return part1, part2 + cost.hw.call_overhead  # part 2's data comes in a transfer request of its own
