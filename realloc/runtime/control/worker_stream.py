"""A worker's side of a generation call that streams without migration (a ``tail`` entry with ``instances=0``,
graph/tail.py; docs/tail-semantics.md). The call takes two ``RunCall`` requests:

1. The first runs the interface function once with a stand-in model that records its ``generate`` call
   (``worker_tail.GenerateRecorder``), decodes this replica's rows to the split point (``models/stream_decode.py``: the
   replicas count the call's running rows together after every step; at dp >= 2 in windowed asynchronous
   all-reduces, ``worker_tail.AsyncCounts``), runs the interface function on the rows
   finished by then (its ``generate`` answered with their results) and replies with them. The decoding state
   (micro-batches, KV caches, sampling streams) stays in ``kept``, keyed by call and iteration.
2. The second (its ``rows``: this replica's running rows, as the master derives them) continues that state to the
   end and runs the interface function on those rows. Between the two, the master moves the finished rows to the
   consumers off the generation's mesh, which start on them.

With ``chunks=k`` (chunked streaming) the call takes k + 1 requests: request j <= k continues the kept decoding to
split point j (``graph/tail.split_thresholds``) and replies with the rows finished since the last one; request k + 1
decodes the rest to the end. Every replica takes every request while the call still runs anywhere (it joins the
running-row counts even with no running row of its own).

A multi-turn rollout (an interface with a ``stepwise`` form, ``multiturn.TurnRollouts``) streams the same way,
a turn standing for a decode step: the replicas take turns, count the call's running rollouts after every turn, and
hand on the rollouts finished (the environment said done, or the turn limit or the budget was hit) at each split
point, while the others keep taking turns in place (their environments and kept KV caches stay in the worker).

With ``micro_batches`` (micro-batch streaming across pools, estimator/mb_stream_cost.py) the replica decodes its
micro-batches one after another, as the plain call does, so the split points fall between micro-batches.

Every row is decoded by the same steps as without the entry, so the results are the plain run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist

from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.graph.tail import TailMigration, split_thresholds
from realloc.models.collective_wait import blocking
from realloc.models.stream_decode import SplitGeneration
from realloc.runtime.control.worker_tail import AsyncCounts, GenerateReplay, captured_generate

# (call, iteration) -> the decoding (a SplitGeneration, or a stepwise multi-turn call's state), sequence ids, running
# local positions, inputs, split points passed
Kept = dict[tuple[str, int], tuple[Any, list[int], list[int], Data, int]]


def _rows_of(inputs: Data, positions: list[int]) -> Data:
    idx = torch.tensor(positions, dtype=torch.long)
    return {role: {name: t.index_select(0, idx) for name, t in d.items()} for role, d in inputs.items()}


def _run_on(ctx: CallContext, fn: Callable[[CallContext, Data], CallResult], gen: Any,
            ids: list[int], positions: list[int], inputs: Data, call: str) -> CallResult:
    """The interface function on the rows at local ``positions`` (sequence ids ``ids``), ``generate`` answered
    (a stepwise call reports its finished rows itself)."""
    if not isinstance(gen, SplitGeneration):
        return gen.result(positions)
    replay = GenerateReplay(ctx.model, gen.output(positions), ids, call)
    return fn(dataclasses.replace(ctx, ids=ids, model=replay), _rows_of(inputs, positions))


def streaming_generation(ctx: CallContext, fn: Callable[[CallContext, Data], CallResult], inputs: Data,
                         tail: TailMigration, call: str, kept: Kept,
                         stepwise: Callable[[CallContext, Data], Any] | None = None
                         ) -> tuple[CallResult | None, list[int]]:
    """One of the call's requests on this replica (see the module docstring): the result covers the rows it
    returns beside it, ascending (None and no rows: this replica has none in this part). ``stepwise``: the
    interface's turn-by-turn form (``Interface.stepwise``), for a call that does not generate once."""
    state = kept.pop((call, ctx.iteration), None)
    if state is not None:  # a later request: the running rows to the next split point, or to their end
        gen, seq_ids, running, held, passed = state
        if list(ctx.ids) != [seq_ids[i] for i in running]:
            raise ValueError(f"call {call!r}: request {passed + 1} names rows {list(ctx.ids)}, but this replica "
                             f"decodes {[seq_ids[i] for i in running]}")
        if passed < tail.chunks:
            return _to_split(ctx, fn, gen, seq_ids, held, tail, call, kept, passed, running)
        gen.finish()
        if not running:
            return None, []
        return _run_on(ctx, fn, gen, list(ctx.ids), running, held, call), list(ctx.ids)
    model = ctx.model
    assert model is not None
    if stepwise is not None:  # a multi-turn rollout: turns to the split points
        if model.groups.pp != 1:
            raise ValueError(f"call {call!r}: streaming runs the generation at pp 1 only; give the call pp=1 or drop "
                             f"its 'tail' plan entry")
        state = stepwise(ctx, inputs)
        ids = list(ctx.ids)
        return _to_split(ctx, fn, state, ids, inputs, tail, call, kept, 0, list(range(len(ids))))
    a = captured_generate(ctx, fn, inputs, call)
    gen = SplitGeneration(model, a.prompts, a.gconfig, a.seq_ids, a.n_mbs, tail.micro_batches)
    return _to_split(ctx, fn, gen, a.seq_ids, inputs, tail, call, kept, 0, list(range(len(a.seq_ids))))


def _to_split(ctx: CallContext, fn: Callable[[CallContext, Data], CallResult], gen: Any,
              seq_ids: list[int], inputs: Data, tail: TailMigration, call: str, kept: Kept, passed: int,
              before: list[int]) -> tuple[CallResult | None, list[int]]:
    """Decode to split point ``passed + 1`` and run the interface function on the rows that finished since
    (local positions ``before`` were running)."""
    model = ctx.model
    assert model is not None

    def global_count(local: int) -> int:
        if model.groups.dp == 1:  # one replica: its count is the call's (a gloo all-reduce per step cost 0.1-0.3 ms)
            return local
        t = torch.tensor([local], dtype=torch.long, device=model.device)
        blocking(dist.all_reduce, t, group=model.groups.dp_group)
        return int(t.item())

    threshold = split_thresholds(ctx.batch_size, tail.rows, tail.chunks)[passed]
    if model.groups.dp > 1 and isinstance(gen, SplitGeneration) and gen.late_counts:
        # the counts as asynchronous all-reduces of a few steps each, as a migration's phase 1 takes them: a
        # blocking all-reduce after every step held each replica at every step (docs/streaming.md, "Faster")
        more = gen.until_counted(AsyncCounts(model.groups.dp_group, model.groups.dp), threshold)
    else:
        more = gen.until(global_count, threshold)
    if more:  # the call still runs somewhere: every replica takes the next request
        kept[call, ctx.iteration] = (gen, seq_ids, gen.running(), inputs, passed + 1)
    finished = sorted(set(before) - set(gen.running()))
    if not finished:
        return None, []
    ids = [seq_ids[i] for i in finished]
    return _run_on(ctx, fn, gen, ids, finished, inputs, call), ids
