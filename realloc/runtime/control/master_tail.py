"""Streaming around a generation's long-tail migration, the master's side (rlhfuse.txt §4; docs/streaming.md).

A part of ``Master`` (``master.py``), beside ``IterationSchedule`` whose state it shares. For a GENERATE call G with
a ``tail`` entry (R_t, m) in the plan:

- The workers migrate G's tail themselves (``worker_tail.py``). G's freed dp replicas m..dp-1 reply at the migration
  point, each with the rows it holds then (finished rows only); replicas 0..m-1 reply when G ends, holding the tail.
  The master learns the migration point from those early replies: part 1 is the freed replicas' rows, part 2 the
  rest (the tail, dealt to replicas 0..m-1 in row order as the workers deal it, ``graph/streaming.deal``).
- A split consumer C of G (``graph/streaming.split_consumers``: not a train step, reading only G's outputs, on no
  device of a tail replica) waits for the migration point instead of G's end: its part-1 inputs are sent at once and
  it runs on part 1 (its dp ranks dealt part 1's rows in order), then, after G ends, on part 2. Its outputs live as
  both parts' rows per dp rank.
- Transfers from or to a call whose dp ranks hold row lists (G after its migration point, a split consumer) are
  planned with ``DataLayout(rows=...)`` and moved as runs of consecutive rows; what a part needs later counts as held
  for the planner, so a part-1 transfer moves part 1's rows only.

A stream-only entry with ``chunks=k`` (chunked streaming) takes k + 1 requests of G (``worker_stream.py``): at each
of its k split points the rows finished since the last one go to the split consumers as one more part, and the
last part is the rest, after G ends.

Every other call runs once, as before. The results are those of the unmigrated run, row by row.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from realloc.graph.streaming import Shares, deal, split_consumers
from realloc.graph.transfer_plan import DataLayout, dp_ranges, plan_data_transfer
from realloc.runtime.records.telemetry import RequestRecord
from realloc.runtime.transfer.row_layout import index_runs, row_bytes
from realloc.runtime.wire import protocol

if TYPE_CHECKING:
    from realloc.runtime.control.master_schedule import Node


def split_map(program: Any) -> dict[str, str]:
    """Split consumer -> the generation it streams from, for every generation with a tail entry."""
    plan, graph = program.plan, program.graph
    return {c: g for g in plan.tail for c in split_consumers(plan, graph, g)}


@dataclasses.dataclass
class ConsumerParts:
    """A split consumer's parts in one iteration, as its generation hands them on: (rows per dp rank, whether it is
    the last part, which runs after the generation ends) in ``queue``; the rows dealt so far per dp rank. With
    ``balance_tokens`` the last part's rows (``rest``) are dealt again by their tokens once the generation ends
    (``final``), when their lengths are known."""

    dealt: list[tuple[int, ...]]
    queue: "asyncio.Queue[tuple[Shares, bool]]" = dataclasses.field(default_factory=asyncio.Queue)
    rest: list[int] | None = None
    final: Shares | None = None


class TailStreams:
    """The migration point of generations with a tail entry, and their split consumers (a part of ``Master``)."""

    def _stream_node(self, call: str, t: int) -> "Node":
        from realloc.runtime.control.master_schedule import Node

        return Node("stream", call, t)

    def _stream_deps(self, n: "Node", deps: list["Node"]) -> list["Node"]:
        """A split consumer waits for its generation's migration point, not for its end."""
        gen = self.splits.get(n.name) if n.kind == "call" else None
        if gen is None:
            return deps
        return [self._stream_node(gen, d.t) if d.kind == "call" and d.name == gen and d.t == n.t else d for d in deps]

    def _shares(self, call: str, t: int) -> Shares:
        """Each dp rank's rows of ``call``'s data in iteration t."""
        got = self.row_lists.get((call, t))
        if got is not None:
            return got
        ranges = self._row_ranges(call, t) or dp_ranges(self.program.batch_size, self.program.calls[call].strategy.dp)
        return tuple(tuple(range(lo, hi)) for lo, hi in ranges)

    async def _stream_at_migration(self, call: str, t: int, rec: RequestRecord
                                   ) -> tuple[list[protocol.Reply], RequestRecord] | None:
        """For a generation with a tail entry: wait for the freed replicas' replies (the migration point), record
        where G's rows are, and start the split consumers' part 1. A stream-only entry: the first request's
        replies and the request that continues the call (``_stream_at_split``)."""
        tail = self.program.plan.tail.get(call)
        if tail is None:
            return None
        if tail.streams_only:
            return await self._stream_at_split(call, t, rec)
        lay = self.program.producer(call).layout
        freed = [r for r in rec.ranks if lay.coords_by_device[r][0] >= tail.instances]
        early = await asyncio.gather(*(self.futures[rec.req, r] for r in freed))
        if not all(rep.ok for rep in early):
            return None  # the whole request's wait reports the failure, which stops the run
        held: dict[int, tuple[int, ...]] = {}
        for rep in early:
            held[lay.coords_by_device[rep.rank][0]] = tuple(rep.rows)
            for out in rep.outputs:
                self.data_meta.setdefault((out.key, t), out.tensors)
        part1 = sorted({i for rows in held.values() for i in rows})
        part2 = sorted(set(range(self.program.batch_size)) - set(part1))
        dp = lay.strategy.dp
        self.row_lists[call, t] = deal(part2, tail.instances) + tuple(held.get(k, ()) for k in
                                                                       range(tail.instances, dp))
        self._start_parts(call, t, part1, part2, early)
        return None

    async def _stream_at_split(self, call: str, t: int, rec: RequestRecord
                               ) -> tuple[list[protocol.Reply], RequestRecord]:
        """A generation that streams without migration (``worker_stream.py``): each of its first requests ends at a
        split point with the rows finished since the last one; the split consumers start on them, and the next
        request (the rows each dp replica still decodes) continues the call. G's replicas keep their rows (its
        layout's own shares)."""
        chunks = self.program.plan.tail[call].chunks
        shares = self._shares(call, t)
        self.row_lists[call, t] = shares
        done: set[int] = set()
        replies: list[protocol.Reply] = []
        for j in range(chunks):
            early = await self._wait(rec)
            chunk = {int(i) for rep in early for i in rep.rows}
            for rep in early:
                for out in rep.outputs:
                    self.data_meta.setdefault((out.key, t), out.tensors)
            replies += early
            done |= chunk
            rest = sorted(set(range(self.program.batch_size)) - done)
            self._start_chunk(call, t, sorted(chunk), rest, early, first=j == 0, last=j == chunks - 1)
            running = [[i for i in rows if i not in done] for rows in shares]
            rec = self._send(self.program.calls[call].ranks, "call", call, t, call,
                             lambda req, running=running: protocol.RunCall(req=req, call=call, iteration=t,
                                                                           rows=running))
        return replies, rec

    def _start_parts(self, call: str, t: int, part1: list[int], part2: list[int], early: list[protocol.Reply]
                     ) -> None:
        """Deal G's rows finished at the migration point, ``part1``, and the rest, ``part2``, to the split consumers'
        dp ranks, send their part-1 inputs (G's row lists are known) and let them start."""
        self._start_chunk(call, t, part1, part2, early, first=True, last=True)

    def _parts(self, c: str, t: int) -> ConsumerParts:
        got = self.parts.get((c, t))
        if got is None:
            got = self.parts[c, t] = ConsumerParts([()] * self.program.calls[c].strategy.dp)
        return got

    def _start_chunk(self, call: str, t: int, chunk: list[int], rest: list[int], early: list[protocol.Reply],
                     first: bool, last: bool) -> None:
        """Deal G's rows finished at a split (or the migration) point, ``chunk``, to each split consumer's dp ranks
        as its next part and send their inputs; ``last``: the rest, ``rest``, is the final part. The consumer's
        row lists are the parts dealt so far and the rest dealt as it will be (the rest counts as held by the
        consumer until it moves). With ``balance_tokens`` the chunk is dealt by the tokens ``early`` (its rows'
        replies) report, and the rest again by its own once G ends (``_balance_part_two``)."""
        tokens = self._reply_tokens(call, early)
        for c, g in self.splits.items():
            if g != call:
                continue
            parts = self._parts(c, t)
            mine, later = deal(chunk, len(parts.dealt), tokens), deal(rest, len(parts.dealt))
            parts.dealt = [tuple(sorted(a + b)) for a, b in zip(parts.dealt, mine)]
            self.row_lists[c, t] = tuple(tuple(sorted(a + b)) for a, b in zip(parts.dealt, later))
            parts.queue.put_nowait((mine, False))
            if last:
                parts.rest = rest
                parts.queue.put_nowait((later, True))
            for key in self.graph.call(c).input_data:
                if chunk and key in self.graph.call(call).output_data and (key, t) in self.data_meta:
                    self.pushed.setdefault((c, t), []).extend(self._transfer_rows(key, c, t, only=set(chunk)))
        if first:
            self._stream_done(call, t)

    def _reply_tokens(self, call: str, replies: list[protocol.Reply]) -> dict[int, int] | None:
        """Row -> tokens from a balanced generation's replies (each names its rows), or None: not balancing."""
        if call != self._balanced_generation():
            return None
        return {int(i): int(n) for rep in replies for i, n in zip(rep.rows, rep.row_tokens)}

    def _balance_part_two(self, call: str, t: int, replies: list[protocol.Reply]) -> None:
        """G ended (``replies``: all of its call's): deal each split consumer's last part, the rows that were still
        running at the last split (or the migration) point, by their tokens, before G's outputs move to it."""
        tokens = self._reply_tokens(call, replies)
        if tokens is None:
            return
        for c, g in self.splits.items():
            parts = self.parts.get((c, t))
            if g == call and parts is not None and parts.rest is not None:
                parts.final = deal(parts.rest, len(parts.dealt), tokens)
                self.row_lists[c, t] = tuple(tuple(sorted(x + y)) for x, y in zip(parts.dealt, parts.final))

    def _stream_done(self, call: str, t: int) -> None:
        ev = self._event(self._stream_node(call, t))
        if ev is not None:
            ev.set()

    async def _call_in_parts(self, n: "Node") -> None:
        """A split consumer: a part on the rows of each split (or the migration) point as they come, the last part
        on the rest after the generation ends; its stats, data and samples are all parts'."""
        from realloc.runtime.control.master_schedule import Node

        c, t = n.name, n.t
        ranks = self.program.calls[c].ranks
        parts = self._parts(c, t)
        replies: list[protocol.Reply] = []
        last = False
        while not last:
            part, last = await parts.queue.get()
            if last:
                ev = self._event(Node("call", self.splits[c], t))
                if ev is not None:
                    await ev.wait()
                part = parts.final if parts.final is not None else part  # dealt by tokens at G's end
            recs = self.pushed.pop((c, t), [])
            if not any(part):
                for rec in recs:
                    await self._wait(rec)
                continue
            req = self._send(ranks, "call", c, t, c,
                             lambda req, part=part: protocol.RunCall(req=req, call=c, iteration=t,
                                                                     rows=[list(r) for r in part]))
            for rec in recs:
                await self._wait(rec)
            replies += await self._wait(req)
        self.parts.pop((c, t), None)
        self._finish_call(c, t, replies)

    def _transfer_rows(self, key: str, consumer: str, t: int, only: set[int] | None = None) -> list[RequestRecord]:
        """``_transfer`` between dp ranks holding row lists; with ``only``, just those rows move now (the others
        count as held by the consumer, which gets them with a later transfer)."""
        metas = self.data_meta[(key, t)]
        cached = self.cached.setdefault((key, t), {})
        src = self.program.producer_of(key)
        assert src is not None, key
        n = self.program.batch_size
        prod, dl = self.program.producer(src), self.program.consumer(consumer)
        dst_rows = self._shares(consumer, t)
        producer = DataLayout(prod.mesh, prod.strategy, prod.stages, rows=self._shares(src, t))
        dst = DataLayout(dl.mesh, dl.strategy, dl.stages, rows=dst_rows)
        known = {d: list(v) for d, v in cached.items()}
        later = index_runs(sorted(set(range(n)) - only)) if only is not None else []
        for dev in dl.layout.coords_by_device:
            known.setdefault(dev, []).extend((key, lo, hi) for lo, hi in later)
        plan = plan_data_transfer({key: [row_bytes(metas)] * n}, producer, dst, cached=known)
        for dev, (dp_rank, _, _) in dl.layout.coords_by_device.items():
            rows = [i for i in dst_rows[dp_rank] if only is None or i in only]
            for lo, hi in index_runs(rows):
                if (key, lo, hi) not in cached.setdefault(dev, []):
                    cached[dev].append((key, lo, hi))
        return self._send_transfer(key, consumer, t, plan, metas)

    def _streams_rows(self, key: str, consumer: str, t: int) -> bool:
        """Whether a transfer of ``key`` to ``consumer`` involves dp ranks holding row lists."""
        src = self.program.producer_of(key)
        return (src, t) in self.row_lists or (consumer, t) in self.row_lists

    def _forget_streams(self, k: int) -> None:
        for c in [c for c in self.row_lists if c[1] <= k]:
            del self.row_lists[c]
        for c in [c for c in self.parts if c[1] <= k]:
            del self.parts[c]
        for c in [c for c in self.balanced if c[1] <= k]:  # token-balanced row lists (master_balance.py)
            del self.balanced[c]
        for c in [c for c in self.deal_cache if c[0] <= k]:
            del self.deal_cache[c]
