"""Which rows go where around a generation call's long-tail migration (rlhfuse.txt §4; docs/streaming.md).

Pure functions the master and the workers share, so both derive the same row lists:

- ``deal``: rows dealt to ``parts`` holders in global row order (contiguous runs of the sorted list, sizes
  differing by at most one): the tail to dp replicas 0..m-1, the finished rows of replicas 0..m-1 to the freed
  replicas m..dp-1 (a freed replica keeps its own finished rows), a split consumer's parts to its dp ranks;
- ``split_consumers``: the calls that run in two parts (part 1 on the rows finished at the migration point, part 2
  on the tail once the generation ends): non-train calls reading only the generation's outputs (or dataset keys),
  on devices that no tail replica uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from realloc.graph.partial_check import partial_rollout_calls
from realloc.graph.row_deal import deal_rows
from realloc.strategy import even_ranges

if TYPE_CHECKING:
    from realloc.graph.dataflow import DataflowGraph
    from realloc.graph.plan import ExecutionPlan
    from realloc.graph.tail import TailMigration

Shares = tuple[tuple[int, ...], ...]  # per dp rank, its rows (global sequence indices, ascending)


def deal(rows: Sequence[int], parts: int, tokens: Mapping[int, int] | None = None) -> Shares:
    """``rows`` sorted and cut into ``parts`` contiguous runs of the sorted list (earlier parts take the
    remainder); with ``tokens`` (row -> its tokens, ``balance_tokens``) each part gets a list of the rows with
    near-equal tokens instead (``row_deal.deal_rows``; ascending)."""
    s = sorted(int(i) for i in rows)
    if tokens is not None and s:
        return tuple(tuple(s[j] for j in part) for part in deal_rows([tokens[i] for i in s], parts))
    return tuple(tuple(s[lo:hi]) for lo, hi in even_ranges(len(s), parts))


def tail_devices(plan: "ExecutionPlan", graph: "DataflowGraph", call: str) -> set[int]:
    """Devices of ``call``'s dp replicas 0..m-1 (all its devices when it has no tail entry or only streams)."""
    from realloc.graph.transfer_plan import Layout

    p = plan.placements[call]
    mesh = graph.spec.cluster.mesh(p.mesh)
    lay = Layout(mesh, p.strategy)
    m = plan.tail[call].instances if call in plan.tail and not plan.tail[call].streams_only else p.strategy.dp
    return {d for d, (dp_rank, _, _) in lay.coords_by_device.items() if dp_rank < m}


def split_consumers(plan: "ExecutionPlan", graph: "DataflowGraph", call: str) -> list[str]:
    """The consumers of generation ``call`` that run in two parts under its tail entry (none without one): not a
    train step, every data input the generation's or the dataset's, and no device shared with a tail replica."""
    if call not in plan.tail:
        return []
    busy = tail_devices(plan, graph, call)
    produced = set(graph.call(call).output_data)
    out = []
    for c in graph.topo_order:
        rpc = graph.call(c)
        if c == call or rpc.is_train or not produced & set(rpc.input_data):
            continue
        if any(k not in produced and k not in graph.spec.dataset_keys for k in rpc.input_data):
            continue
        p = plan.placements[c]
        if busy & set(graph.spec.cluster.mesh(p.mesh).device_ids):
            continue
        out.append(c)
    return out


def tail_unsupported(graph: "DataflowGraph", call: str, partial: Sequence[str] = (),
                     streams_only: bool = False) -> str | None:
    """Why ``call``'s interface cannot migrate (``streams_only``: stream) its tail at all (the planner offers it
    none, the runtime refuses one), or None: a rollout generated turn by turn migrates no rollout mid-way (its
    environments' state lives in the worker that runs them), and streams its finished rollouts only with a stepwise
    form (``Interface.stepwise``); one whose rows are cut and carried (partial rollouts, ``partial`` =
    graph/partial_check.partial_rollout_calls) does neither."""
    iface = graph.interfaces.get(call)
    if iface is not None and not iface.migrates_tail and not (streams_only and iface.stepwise is not None):
        if iface.stepwise is not None:
            return (f"interface {iface.name!r} generates turn by turn (multi-turn), so its unfinished rollouts cannot "
                    f"migrate (each one's environment lives in the worker that runs it); stream its finished "
                    f"rollouts instead (instances=0)")
        return f"interface {iface.name!r} generates turn by turn (multi-turn), so its rows cannot migrate mid-rollout"
    if call in partial:
        return "partial rollouts (partial_rollout_tokens) carry unfinished rows to the next iteration instead"
    return None


def check_runtime_tail(plan: "ExecutionPlan", graph: "DataflowGraph") -> None:
    """One ValueError if the runtime cannot carry out a tail entry of ``plan``: a migrating generation must run at pp
    1 (its replicas count decode steps in lockstep, and phase 2 re-runs a prefill at pp 1); streaming runs at any pp
    (micro-batch streaming in waves of pp micro-batches; a multi-turn stream at pp 1 only). Staleness > 0 runs: the schedule already starts
    the generation of iteration t + 1 only after iteration t's whole call (it reads parameters whose train step, or
    whose snapshot, waits for that call: master_schedule._stale_readers, _snapshot_deps), so the freed devices run
    the split consumers' part 1 first, and a streamed call's second request comes before the next call's first."""
    partial = partial_rollout_calls(graph)
    for call, t in plan.tail.items():
        why = tail_unsupported(graph, call, partial, t.streams_only)
        if why:
            raise ValueError(f"plan field 'tail' entry {call!r}: {why}; drop the entry")
        p = plan.placements[call]
        iface = graph.interfaces.get(call)
        turn_by_turn = iface is not None and not iface.migrates_tail  # a multi-turn loop of its own, at pp 1
        if p.pp != 1 and turn_by_turn:
            raise ValueError(f"plan field 'tail' entry {call!r}: interface {iface.name!r} generates turn by turn, "
                             f"which the runtime streams at pp 1 only, and the call runs at pp {p.pp}; place it with "
                             f"pp=1 or drop the entry")
        if t.micro_batches and turn_by_turn:
            raise ValueError(f"plan field 'tail' entry {call!r}: micro_batches hands on the micro-batches of a "
                             f"generation decoded row by row only (the call runs turn by turn); drop micro_batches")
        if t.micro_batches:
            _check_mb_entry(graph, call, t, p.n_mbs, p.pp)
        if p.pp != 1 and not t.streams_only:  # streaming steps through the stages (stream_pipeline.py)
            raise ValueError(f"plan field 'tail' entry {call!r}: the runtime migrates the tail of a generation at pp "
                             f"1 only (it streams at any pp: instances=0), and the call runs at pp {p.pp}; place it "
                             f"with pp=1, set instances=0 or drop the entry")


def _check_mb_entry(graph: "DataflowGraph", call: str, t: "TailMigration", n_mbs: int, pp: int = 1) -> None:
    """A ``micro_batches`` entry hands on each micro-batch but the last as it ends: its split points are the running
    counts after each one (``split_thresholds(n, n / m, m - 1)``, micro-batches being equal, graph/plan.py), so
    ``chunks`` must be m - 1 and ``rows`` n / m. Another entry ran its splits elsewhere (fewer hand-offs, an empty
    chunk) than its table line and its price (the call's m micro-batches, estimator/mb_stream_cost.py) said. At pp
    > 1 the unit is a wave of pp micro-batches (models/stream_decode.py): m = n_mbs / pp."""
    n = graph.spec.n_seqs(graph.call(call))
    if pp > 1:
        if n_mbs % pp or n_mbs < 2 * pp:
            raise ValueError(f"plan field 'tail' entry {call!r}: micro_batches at pp {pp} hands on waves of {pp} "
                             f"micro-batches, so n_mbs must be a multiple of {pp} and at least {2 * pp} (got "
                             f"{n_mbs}); set n_mbs={2 * pp} or drop the entry")
        m = n_mbs // pp
        if (t.chunks, t.rows) != (m - 1, n // m):
            raise ValueError(f"plan field 'tail' entry {call!r}: micro_batches at pp {pp} hands on each of the "
                             f"call's {m} waves of {pp} micro-batches but the last as it ends, so chunks must be "
                             f"{m - 1} and rows the last wave's {n // m} of {n} (got chunks={t.chunks}, "
                             f"rows={t.rows}); set chunks={m - 1}, rows={n // m}")
        return
    if n_mbs < 2:
        raise ValueError(f"plan field 'tail' entry {call!r}: micro_batches hands on each micro-batch but the last as "
                         f"it ends, and the call runs in {n_mbs} micro-batch; give it n_mbs >= 2 or drop the entry")
    if (t.chunks, t.rows) != (n_mbs - 1, n // n_mbs):
        raise ValueError(f"plan field 'tail' entry {call!r}: micro_batches hands on each of the call's {n_mbs} "
                         f"micro-batches but the last as it ends, so chunks must be {n_mbs - 1} and rows the last "
                         f"micro-batch's {n // n_mbs} of {n} (got chunks={t.chunks}, rows={t.rows}); set "
                         f"chunks={n_mbs - 1}, rows={n // n_mbs}")
