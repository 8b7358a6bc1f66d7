"""Long-tail migration as a plan choice of the search (issue 31 item 3; rlhfuse.txt §4, Fig. 9).

For a GENERATE call whose response lengths vary, every candidate on a single-stage mesh with dp >= 2 also comes
with each migration (R_t, m): R_t from ``estimator.tail_cost.TAIL_GRID`` (shares of the call's rows), m from 1 to
dp - 1 (powers of two beyond dp 8), as long as the tail's ceil(R_t / m) rows per replica fit the KV cache the
replica already holds (so memory stays as priced), and every candidate at pp 1 (any dp) on a mesh smaller than the
cluster with streaming only (m = 0, R_t from the same grid: no row moves, the whole mesh decodes to the end,
``estimator/stream_cost.py``), each streaming row also in k chunks for k in ``chunk_cost.CHUNK_GRID`` (chunked
streaming, ``estimator/chunk_cost.py``: grid index g + len(TAIL_GRID) x (1 + the chunk count's index)). Such a row's
time is phase 1; ``TailChoice`` keeps the rest
(``search/tail_problem.py`` says how the simulators read it). The MCMC reaches the choices through its usual
moves: candidates of one layout (its "n_mbs" move) differ in n_mbs and migration, so a move there turns the tail
on, off or to another (R_t, m); a migration keeps its own shape class, so a "position" move keeps it.

A multi-turn call (a turn profile whose rollouts end at different turns) gets the stream-only rows only, priced by
turns (``estimator/turn_stream_cost.py``): its unfinished rollouts never migrate.

Every non-train consumer of such a call may run in two parts (``TailSplit``), priced per candidate and grid entry.
Fixed lengths on one pool, or no eligible call: no row is added and the problem is exactly the one of before. On a
cluster of pools every generation candidate with n_mbs in ``mb_stream_cost.MB_GRID`` (at pp > 1, n_mbs / pp in it: waves
of pp micro-batches) also gets a micro-batch streaming row, at any lengths (``search/mb_stream_space.py``; grid indices
after the ones above).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from realloc.calls import InterfaceType
from realloc.estimator.cost import CostModel
from realloc.estimator.chunk_cost import CHUNK_GRID, chunk_work, chunked_generation_cost, lead_shares
from realloc.estimator.pp_stream_cost import stream_phase1, stream_rest
from realloc.estimator.tail_cost import TAIL_GRID, consumer_parts, phase1_cost, tail_phase_cost, tail_rows
from realloc.estimator.turn_stream_cost import running_after, split_turns, turn_lead_shares, turn_stream_cost
from realloc.envs.rollout_args import rollout_shape
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.partial_check import partial_rollout_calls
from realloc.graph.streaming import split_consumers, tail_unsupported
from realloc.graph.tail import TailMigration
from realloc.search.candidates import CallCosts
from realloc.estimator.mb_stream_cost import MB_GRID, last_rows
from realloc.search.mb_stream_space import (MB_BASE, mb_of, mb_rows, mb_split_columns,
                                             streams_micro_batches)
from realloc.search.tail_problem import TailColumns, TailSplit
from realloc.search.tail_reference import TailView

# Beyond this many dp replicas, m runs over powers of two only (the candidates would grow as dp x grid).
MAX_DENSE_INSTANCES = 8


@dataclasses.dataclass(frozen=True)
class TailChoice:
    """One migrating candidate row: the plan's entry, its grid index, the tail devices and seconds after phase 1."""

    migration: TailMigration
    grid: int
    width: int
    tail: float
    lead: float = 0.0  # chunked streaming: seconds from the first split point to the last


def grid_entry(g: int) -> tuple[float, int]:
    """(R_t's share of the rows, chunks) of an extended grid index (the module docstring)."""
    return TAIL_GRID[g % len(TAIL_GRID)], ((1,) + CHUNK_GRID)[g // len(TAIL_GRID)]


def eligible(graph: DataflowGraph, call: str) -> bool:
    """Whether ``call`` may migrate its tail: a model's GENERATE call under response lengths that vary (more than
    one length possible; with one, every row ends at once and there is no tail), or at any lengths on a cluster of
    pools (micro-batch streaming). A multi-turn call may stream (never migrate) when its profile's rollouts end at
    different turns (``turn_stream_cost.py``)."""
    spec, rpc = graph.spec, graph.call(call)
    if rpc.interface_type is not InterfaceType.GENERATE or graph.model_config(call) is None:
        return False
    shape = rollout_shape(call, graph.interfaces.get(call), rpc.interface_args, spec.gen_len)
    if shape is not None:
        return (min(shape.profile.reach) < 1
                and tail_unsupported(graph, call, partial_rollout_calls(graph), streams_only=True) is None)
    return ((varied_lengths(graph) or streams_micro_batches(graph))  # micro-batches stream at any lengths
            and tail_unsupported(graph, call, partial_rollout_calls(graph)) is None)


def varied_lengths(graph: DataflowGraph) -> bool:
    spec = graph.spec
    return bool(np.count_nonzero(spec.response_lengths.pmf(spec.gen_len)) > 1)


def instance_choices(dp: int) -> list[int]:
    if dp <= MAX_DENSE_INSTANCES:
        return list(range(1, dp))
    return [m for m in (2 ** k for k in range(dp.bit_length())) if m < dp]


def with_tail_rows(graph: DataflowGraph, cost: CostModel, call: str, cc: CallCosts,
                   pp_streams: bool = False) -> tuple[CallCosts, tuple[TailChoice | None, ...]]:
    """``cc`` with a migrating row after the rows for each (candidate, R_t, m) worth trying, and per row its
    migration (None: the candidate of before). ``pp_streams`` (a hand plan's estimate): candidates at pp > 1 get
    row-streaming rows too, priced as the runtime steps the stages (``estimator/pp_stream_cost.py``; the search does
    not offer them), and micro-batch rows come on one pool too."""
    n = cost.workload(call).n_seqs
    n_devices = graph.spec.cluster.n_devices
    rows, choices = [], []
    phase1: dict[tuple, float] = {}
    phase2: dict[tuple, tuple[float, float, bool]] = {}
    multiturn = cost.rollout_shape(call) is not None  # streams only, priced by turns (turn_stream_cost.py)
    varied, by_mb = varied_lengths(graph), streams_micro_batches(graph) or pp_streams  # a hand plan's, on one pool
    for i, cand in enumerate(cc.options):
        s = cand.strategy
        streams = s.pp == 1 and cand.mesh.size < n_devices  # a mesh that leaves devices for a consumer to stream to
        if pp_streams and s.pp > 1 and cand.mesh.size < n_devices and varied and not multiturn:
            rows_stream, choices_stream = stream_rows(cost, call, i, cand, n, phase1)
            rows += rows_stream
            choices += choices_stream
        if streams and multiturn:
            rows_stream, choices_stream = turn_stream_rows(cost, call, i, cand, n)
            rows += rows_stream
            choices += choices_stream
        elif streams and varied:  # streaming without migration (m = 0, stream_cost.py), at any dp
            rows_stream, choices_stream = stream_rows(cost, call, i, cand, n, phase1)
            rows += rows_stream
            choices += choices_stream
        if (streams or s.pp > 1 and cand.mesh.size < n_devices) and by_mb and not multiturn:  # mb_stream_space.py
            rows_mb, choices_mb = mb_rows(cost, call, i, cand, n)
            rows += rows_mb
            choices += [TailChoice(*f) for f in choices_mb]
        if s.pp != 1 or s.dp < 2 or multiturn or not varied:
            continue
        per_replica = cost.workload(call).micro_batch(s.dp, cand.n_mbs) * cand.n_mbs
        shape = (cand.mesh.n_nodes, cand.mesh.n_devs)
        for g, share in enumerate(TAIL_GRID):
            r_t = tail_rows(n, share)
            best_tail = float("inf")
            for m in instance_choices(s.dp):
                if -(-r_t // m) > per_replica:  # the tail would need a larger KV cache than the replica holds
                    continue
                key = (shape, s, r_t, m)
                if key not in phase2:
                    phase2[key] = tail_phase_cost(cost, call, cand.mesh, s, r_t, m)
                tail = phase2[key][0] + phase2[key][1]
                if tail >= best_tail:  # more replicas keep fewer devices free and are no faster
                    continue
                best_tail = tail
                k1 = (shape, s, cand.n_mbs, r_t)
                if k1 not in phase1:
                    phase1[k1] = phase1_cost(cost, call, cand.mesh, s, cand.n_mbs, r_t)
                rows.append((i, phase1[k1]))
                # the runtime moves the caches unless the plan says "prefill": written where that is priced cheaper
                how = {} if phase2[key][2] else {"kv": "prefill"}
                choices.append(TailChoice(TailMigration(rows=r_t, instances=m, **how), g, m * s.tp, tail))
                if pp_streams:  # a hand plan's estimate: the other way too, to price the plan's kv as it runs
                    other = "prefill" if phase2[key][2] else "move"
                    mig, ph2, _ = tail_phase_cost(cost, call, cand.mesh, s, r_t, m, other)
                    rows.append((i, phase1[k1]))
                    choices.append(TailChoice(TailMigration(rows=r_t, instances=m, kv=other), g, m * s.tp, mig + ph2))
    if not rows:
        return cc, (None,) * len(cc.options)
    idx = [i for i, _ in rows]
    out = CallCosts(cc.options + tuple(cc.options[i] for i in idx), np.r_[cc.time, [t for _, t in rows]],
                    cc.static + tuple(cc.static[i] for i in idx), cc.dynamic + tuple(cc.dynamic[i] for i in idx),
                    cc.param + tuple(cc.param[i] for i in idx))
    return out, (None,) * len(cc.options) + tuple(choices)


def stream_rows(cost: CostModel, call: str, i: int, cand, n: int,
                phase1: dict[tuple, float]) -> tuple[list[tuple[int, float]], list[TailChoice]]:
    """Candidate ``i``'s stream-only rows, one per grid R_t: phase 1 as a migration's, then the rest of the plain
    time and one more call overhead (``estimator/stream_cost.py``); the tail devices are the whole mesh (none is
    freed)."""
    s = cand.strategy
    rows, choices = [], []
    for g, share in enumerate(TAIL_GRID):
        r_t = tail_rows(n, share)
        k1 = ((cand.mesh.n_nodes, cand.mesh.n_devs), s, cand.n_mbs, r_t)
        if k1 not in phase1:
            phase1[k1] = stream_phase1(cost, call, cand.mesh, s, cand.n_mbs, r_t)
        rest = stream_rest(cost, call, cand.mesh, s, cand.n_mbs, r_t, phase1[k1])
        rows.append((i, phase1[k1]))
        choices.append(TailChoice(TailMigration(rows=r_t, instances=0), g, s.dp * s.tp * s.pp, rest))
    for ci, k in enumerate(CHUNK_GRID):  # chunked streaming (estimator/chunk_cost.py)
        for g, share in enumerate(TAIL_GRID):
            r_t = tail_rows(n, share)
            if k > n - r_t:
                continue
            tc, lead = chunked_generation_cost(cost, call, cand.mesh, s, cand.n_mbs, r_t, k)
            rows.append((i, tc.phase1))
            choices.append(TailChoice(TailMigration(rows=r_t, instances=0, chunks=k), g + len(TAIL_GRID) * (1 + ci),
                                      s.dp * s.tp * s.pp, tc.phase2, lead))
    return rows, choices


def turn_stream_rows(cost: CostModel, call: str, i: int, cand, n: int
                     ) -> tuple[list[tuple[int, float]], list[TailChoice]]:
    """A multi-turn candidate ``i``'s stream-only rows, one per (R_t, chunks) of the grid, priced by turns."""
    s = cand.strategy
    rows, choices = [], []
    for ci, k in enumerate((1,) + CHUNK_GRID):
        for g, share in enumerate(TAIL_GRID):
            r_t = tail_rows(n, share)
            if k > n - r_t:
                continue
            tc, lead, _ = turn_stream_cost(cost, call, cand.mesh, s, cand.n_mbs, r_t, k)
            rows.append((i, tc.phase1))
            choices.append(TailChoice(TailMigration(rows=r_t, instances=0, chunks=k), g + len(TAIL_GRID) * ci,
                                      s.dp * s.tp * s.pp, tc.phase2, lead))
    return rows, choices


def _turn_parts(cost: CostModel, call: str, producer: str, cand, running: tuple[int, ...]) -> tuple[float, float]:
    """(part 1, part 2) of a split consumer of a multi-turn stream whose last split point leaves ``running[-1]``
    rollouts running; none left: everything in part 1 and no last part."""
    if running[-1]:
        return consumer_parts(cost, call, producer, cand.mesh, cand.strategy, cand.n_mbs, running[-1])
    return cost.call_cost(call, cand.mesh, cand.strategy, cand.n_mbs).time, 0.0


def tail_arrays(graph: DataflowGraph, cost: CostModel, calls: Sequence[str], options: Sequence[Sequence],
                tails: Sequence[Sequence[TailChoice | None]], data_edges: Sequence[tuple[int, int]],
                ) -> tuple[tuple[tuple[int, TailColumns], ...], tuple[TailSplit, ...]]:
    """The search problem's tail arrays (``SearchProblem.tail_columns``, ``tail_splits``) for the rows' choices."""
    columns = []
    for c, choices in enumerate(tails):
        if any(t is not None for t in choices):
            leads = [0.0 if t is None else t.lead for t in choices]
            columns.append((c, TailColumns([-1 if t is None else t.grid for t in choices],
                                           [0 if t is None else t.width for t in choices],
                                           [0.0 if t is None else t.tail for t in choices],
                                           leads if any(leads) else np.zeros(0))))
    migrating = {c for c, _ in columns}
    chunked = {c for c, cols in columns if cols.lead.size}
    readers = {u: sum(1 for a, v in set(data_edges) if a == u and v not in migrating
                      and graph.call(calls[v]).interface_type is not InterfaceType.TRAIN_STEP) for u in migrating}
    n_grid = len(TAIL_GRID) * (1 + len(CHUNK_GRID))
    if any(t is not None and t.migration.micro_batches for choices in tails for t in choices):
        n_grid = MB_BASE + len(MB_GRID)
    depth = max(CHUNK_GRID) - 1
    splits, split_calls = [], set()
    for e, (u, v) in enumerate(data_edges):
        if u not in migrating or v in migrating or v in split_calls:
            continue
        if graph.call(calls[v]).interface_type is InterfaceType.TRAIN_STEP:
            continue  # a train call runs once, after the generation ends
        n = cost.workload(calls[u]).n_seqs
        r_t = [tail_rows(n, grid_entry(g)[0]) if mb_of(g) is None else last_rows(n, mb_of(g))
               for g in range(n_grid)]
        turns = running_after(cost, calls[u]) if cost.rollout_shape(calls[u]) is not None else None
        # a multi-turn stream: the rollouts running at each split point, as the turns say (turn_stream_cost.py)
        at = [None if turns is None or mb_of(g) is not None or grid_entry(g)[1] > n - r_t[g] else
              tuple(turns[k - 1] for k in split_turns(turns, n, r_t[g], grid_entry(g)[1])) for g in range(n_grid)]
        part1 = np.zeros((len(options[v]), n_grid))
        part2 = np.zeros_like(part1)
        work = np.zeros((len(options[v]), n_grid, depth if u in chunked else 0))
        share = np.zeros((n_grid, work.shape[2]))
        seen: dict[tuple, tuple[float, float]] = {}
        seen_chunks: dict[tuple, tuple[float, ...]] = {}
        for g in range(n_grid):
            k = grid_entry(g)[1] if mb_of(g) is None else 1
            if 1 < k <= n - r_t[g] and u in chunked:
                share[g, :k - 1] = (lead_shares(cost, calls[u], r_t[g], k, readers[u]) if turns is None else
                                    turn_lead_shares(turns, n, r_t[g], k, readers[u]))
        for i, cand in enumerate(options[v]):
            for g, rows in enumerate(r_t):
                if mb_of(g) is not None:  # micro-batch streaming across pools (mb_stream_space.py)
                    key = (cand.mesh.n_nodes, cand.mesh.n_devs, cand.mesh.pool, cand.strategy, cand.n_mbs, "mb", g)
                    if key not in seen_chunks:
                        seen_chunks[key] = mb_split_columns(cost, calls[v], calls[u], cand, g, readers[u])
                    part1[i, g], part2[i, g], w, sh = seen_chunks[key]
                    if u in chunked and w:
                        work[i, g, :len(w)] = w
                        share[g, :len(sh)] = sh
                    continue
                key = (cand.mesh.n_nodes, cand.mesh.n_devs, cand.mesh.pool, cand.strategy, cand.n_mbs, rows,
                       at[g] and at[g][-1])
                if key not in seen:
                    seen[key] = (consumer_parts(cost, calls[v], calls[u], cand.mesh, cand.strategy, cand.n_mbs, rows)
                                 if at[g] is None else _turn_parts(cost, calls[v], calls[u], cand, at[g]))
                part1[i, g], part2[i, g] = seen[key]
                k = grid_entry(g)[1]
                if k == 1 or k > n - rows or u not in chunked:
                    continue
                if (key, k, at[g]) not in seen_chunks:
                    seen_chunks[key, k, at[g]] = chunk_work(cost, calls[v], calls[u], cand.mesh, cand.strategy,
                                                            cand.n_mbs, rows, k, at[g])
                c = seen_chunks[key, k, at[g]]
                part1[i, g] = c[-1]  # the last chunk, after the last split point; the earlier ones from j on:
                work[i, g, :k - 1] = [sum(c[j:]) for j in range(k - 1)]
        share1 = np.array([(n - (r if a is None else a[-1])) / n for r, a in zip(r_t, at)])
        splits.append(TailSplit(e, part1, part2, share1, 1.0 - share1, work, share))
        split_calls.add(v)
    return tuple(columns), tuple(splits)


def without_tails(space, starts: Sequence[np.ndarray]):
    """A PlanSpace (``search/build.py``) restricted to its candidates without migration, and ``starts`` (plans of
    such candidates) in its numbering."""
    rows = [[i for i in range(len(k)) if space.tail_of(c, i) is None] for c, k in enumerate(space.problem.candidates)]
    where = [{i: j for j, i in enumerate(r)} for r in rows]
    for c, w in enumerate(where):  # a start with a tail row (a pool's plan that streams): its candidate without
        plain = {space.options[c][i]: j for i, j in w.items()}
        for i in range(len(space.problem.candidates[c])):
            if i not in w and space.options[c][i] in plain:
                w[i] = plain[space.options[c][i]]
    n = space.problem.n_calls  # a plan's entries after its calls' (fused pairs' 0/1) keep their values
    return space.restrict(rows), [np.asarray([where[c][int(i)] for c, i in enumerate(s[:n])] + [int(x) for x in s[n:]],
                                             np.int32) for s in starts]


def drop_idle_streams(space, indices: np.ndarray) -> np.ndarray:
    """``indices`` (a plan of the PlanSpace ``space``) without its stream entries that split no consumer
    (``graph/streaming.split_consumers``: every call reading the generation's rows shares its devices or reads
    another call's key). Such an entry streams to no call: the runtime runs the generation as without it, in one
    more request, and the simulator prices it the plain call's time plus that request, a list-schedule ordering
    away from the plain placement (docs/streaming.md, "A longer batch"). A migration stays: its freed devices run
    any call. Returns ``indices`` itself when there is none."""
    plan = space.to_plan(indices, "search")
    idle = {g for g, t in plan.tail.items() if t.streams_only and not split_consumers(plan, space.graph, g)}
    if not idle:
        return indices
    kept = untailed_indices(space, plan, idle)
    return indices if kept is None else kept


def untailed_indices(space, plan, calls: set[str]) -> np.ndarray | None:
    """The indices of ``plan`` (a plan of the PlanSpace ``space``) without the tail entries of ``calls``; None when
    such a placement has no plain row in ``space``: the search's pruning keeps a row with a tail that is fast
    enough alone and may drop its plain row, slower alone than a baseline's whole iteration (no plan to show or
    keep: plan_search)."""
    try:
        return space.indices_of(plan.model_copy(update={"tail": {g: t for g, t in plan.tail.items() if g not in calls}}))
    except ValueError:
        return None


def split_times(problem, indices: Sequence[int]) -> dict[int, float]:
    """Seconds of each consumer that runs in two parts under the plan ``indices``: part 1 + part 2, by call index."""
    view = TailView(problem, indices)
    out = {}
    for c in view.split_of:
        split = view.split(c)
        if split is not None:
            s, _, g = split
            out[c] = view.part1(c) + float(s.part2[int(indices[c]), g])
    return out
