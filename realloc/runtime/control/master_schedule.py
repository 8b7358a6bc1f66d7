"""The augmented, unrolled dataflow graph and its schedule (realhf.txt §3, §4; Figure 13).

``IterationSchedule`` is one part of ``Master`` (``master.py``), which creates the state these methods share.

The unrolled dataflow graph is augmented with the nodes the plan implies (``program.py``): a
reallocation wherever consecutive calls of one model use different layouts (including from the last
call of one iteration to the first of the next), offload/reload of models the plan keeps in host
memory, evaluation passes and checkpoint saves. One asyncio coroutine per node waits for the node's
dependencies (data, parameter versions, reallocations), then dispatches its requests. Calls on
disjoint meshes therefore run at the same time, and calls of iteration t+1 start as soon as their own
dependencies are met, while iteration t is still finishing elsewhere. At most ``window`` iterations
are in flight; finished iterations are reported in order (metrics.jsonl, samples, the trace).

Messages carry metadata only. The master knows where every piece of data lives (the producer's
layout plus the ranges each device already received) and plans each transfer with the shared
planner, so no device is sent data it holds. A call's outputs are sent to all their consumers as soon
as it finishes (the augmented graph's data-transfer nodes follow their producer), so a transfer never
waits behind work dispatched later on the producer's devices. A process group needed by a data plan
for the first time is created by a request to every worker, ordered like every other request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from realloc.algorithms.pairs.reward_model import pair_metrics
from realloc.calls import InterfaceType
from realloc.graph.transfer_plan import TransferPlan, dp_ranges
from realloc.runtime.control.master_link import RunFailed
from realloc.runtime.control.master_balance import deal_rows_cached, defer_push, flush_deferred
from realloc.runtime.control.program import Realloc
from realloc.runtime.records.run_paths import naming, os_error_line
from realloc.runtime.records.telemetry import RequestRecord, iteration_metrics
from realloc.runtime.records.text_io import write_samples
from realloc.runtime.transfer.row_layout import row_bytes
from realloc.runtime.wire import protocol


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str  # call | realloc | offload | reload | save
    name: str  # the call; the model for realloc/offload/reload; "" for save
    t: int
    src: str = ""  # realloc: source call (layout)
    dst: str = ""  # realloc: destination call (layout)

    @property
    def label(self) -> str:
        if self.kind == "call":
            return self.name
        if self.kind == "realloc":
            return f"realloc {self.name}: {self.src}->{self.dst}"
        return f"{self.kind} {self.name}".strip()


class IterationSchedule:
    """The nodes of each iteration, their dependencies, and running them (a part of ``Master``)."""

    def _nodes(self, t: int) -> list[Node]:
        prog = self.program
        nodes = [Node("call", c, t) for c in self.graph.topo_order]
        for m in prog.models:
            nodes += [Node("realloc", m, t, r.src_call, r.dst_call) for r in prog.reallocs(m)]
            if m in self.offloaded:
                nodes.append(Node("offload", m, t))
                if t > self.start:
                    nodes.append(Node("reload", m, t))
        if self._evaluates(t):
            nodes += [Node("eval", "generate", t), Node("eval", "reward", t)]
        if self._saves_after(t):
            nodes.append(Node("save", "", t))
        return nodes

    def _deps(self, n: Node) -> list[Node]:
        prog, t = self.program, n.t
        out: list[Node] = []
        stale = (n.kind == "call" and prog.is_stale(n.name)) or (n.kind == "realloc" and n.src != "" and
                                                                  self._is_snapshot(n))
        if n.kind in ("call", "realloc"):
            model = prog.calls[n.name].model if n.kind == "call" else n.name
            if model in self.offloaded and t > self.start:
                out.append(Node("reload", model, t))
            # A save reads home after iteration t - 1; what runs ahead only reads it, and must not wait (the
            # save waits for the train step that waits for the generation running ahead).
            if t > self.start and self._saves_after(t - 1) and not stale:
                out.append(Node("save", "", t - 1))
        if n.kind == "call":
            out += [Node("call", u, t) for u in self.graph.graph.predecessors(n.name)
                    if not (prog.is_stale(u) and self.graph.graph.edges[u, n.name]["kind"] == "param")]
            lag = 1 + prog.staleness if prog.is_stale(n.name) else 1
            if t - lag >= self.start:
                out += [Node("call", u, t - lag) for u, v in self.graph.carry_edges if v == n.name]
            r = prog.snapshot_of(n.name) if prog.is_stale(n.name) else self._realloc_into(n.name)
            if r is not None:
                out.append(Node("realloc", r.model, t, r.src_call, r.dst_call))
            out += self._stale_readers(n)
            out = self._stream_deps(n, out)
        elif n.kind == "realloc":
            r = next(x for x in prog.reallocs(n.name) if (x.src_call, x.dst_call) == (n.src, n.dst))
            if r.snapshot:
                out += self._snapshot_deps(r, t)
            else:
                tt = t - 1 if r.wraps else t
                if tt >= self.start:
                    out += [Node("call", c, tt) for c in r.after]
                out += self._stale_readers(n)
        elif n.kind == "offload":
            out += [Node("call", c, t) for c in prog.chain_calls(n.name)]
            out += [Node("realloc", n.name, t, r.src_call, r.dst_call) for r in prog.reallocs(n.name)]
        elif n.kind == "reload":
            out.append(Node("offload", n.name, t - 1))
        elif n.kind == "save":
            out += [x for x in self._nodes(t) if x.kind != "save"]
        elif n.kind == "eval":
            ec = self.eval_calls
            out += ([Node("call", ec.train, t)] if n.name == "generate" else
                    [Node("eval", "generate", t), Node("call", ec.reward, t)])
            return out
        # An evaluation runs in the layouts of the actor's train step and of the reward call, right after
        # them: what moves their parameters (reallocation, offload) or changes them (a later iteration)
        # waits for it too. The same iteration's consumers of the reward do not: the evaluation waits for
        # the actor's train step, which needs them.
        anchors = {self.eval_calls.train: "generate", self.eval_calls.reward: "reward"} if self.eval_calls else {}
        if self.eval_calls and self.eval_calls.self_scored:  # no pass in the (generating) reward call's layout
            anchors = {self.eval_calls.train: "generate"}
        out += [Node("eval", anchors[d.name], d.t) for d in list(out)
                if d.kind == "call" and d.name in anchors and self._evaluates(d.t)
                and (n.kind in ("realloc", "offload") or d.t < n.t)]
        return out + self._fused_deps(n)  # a fused train pair waits for both calls' inputs (master_fused.py)

    # -- bounded staleness (program.py): generation runs ahead, reading home in place or a snapshot ----------
    def _is_snapshot(self, n: Node) -> bool:
        return any(r.snapshot and (r.src_call, r.dst_call) == (n.src, n.dst) for r in self.program.reallocs(n.name))

    def _snapshot_deps(self, r: Realloc, t: int) -> list[Node]:
        """A snapshot for the generation of iteration t copies the version after the train step of iteration
        t - 1 - eta (the home segment's calls then), once the generation of t - 1 has read the last copy."""
        prog = self.program
        out: list[Node] = []
        src_t = t - 1 - prog.staleness
        if src_t >= self.start:
            out += [Node("call", c, src_t) for c in prog.segments(r.model)[-1].calls]
        if t - 1 >= self.start:
            key = prog.calls[r.dst_call].key
            out += [Node("call", c, t - 1) for c in prog.stale_calls_of(r.model) if prog.calls[c].key == key]
        return out

    def _first_fresh(self, model: str, t: int) -> Node:
        """The first node of iteration t that may change (or move away) the model's home parameters."""
        prog = self.program
        wrap = next((r for r in prog.reallocs(model) if r.wraps and not r.snapshot), None)
        if wrap is not None:
            return Node("realloc", model, t, wrap.src_call, wrap.dst_call)
        return Node("call", prog.fresh_calls(model)[0], t)

    def _stale_readers(self, n: Node) -> list[Node]:
        """For the first node of iteration s that changes a model's home: everything that reads home's
        version s for generation (snapshots, or stale calls in place), i.e. the generations of iteration
        s + eta, and at the run's first iteration S all of S .. S + eta (they read the version it starts with)."""
        prog = self.program
        model = prog.calls[n.name].model if n.kind == "call" else n.name
        if prog.staleness == 0 or not prog.stale_calls_of(model) or n != self._first_fresh(model, n.t):
            return []
        s, eta = n.t, prog.staleness
        its = range(s + eta, s + eta + 1) if s > self.start else range(s, s + eta + 1)
        home = prog.calls[prog.home_call(model)].key
        out: list[Node] = []
        for t in its:
            if t >= self.end:
                break
            out += [Node("realloc", r.model, t, r.src_call, r.dst_call) for r in prog.snapshots(model)]
            out += [Node("call", c, t) for c in prog.stale_calls_of(model) if prog.calls[c].key == home]
        return out

    def _realloc_into(self, call: str) -> Realloc | None:
        m = self.program.calls[call].model
        seg = next(s for s in self.program.segments(m) if call in s.calls)
        return next((r for r in self.program.reallocs(m) if r.dst_call == seg.calls[0]), None)

    async def _run_iterations(self) -> None:
        first = min(self.end, self.start + self.window)
        self.all_done = asyncio.Event()
        for t in range(self.start, first):
            self._spawn(t)
        await self.all_done.wait()

    def _spawn(self, t: int) -> None:
        self.last_spawned = t
        nodes = self._nodes(t)
        self.remaining[t] = len(nodes)
        self.call_stats[t] = {}
        self.node_times[t] = {}
        # Events may exist already: with bounded staleness a train step waits for a later iteration's
        # generation, before that iteration is spawned.
        events = self.done.setdefault(t, {})
        for n in nodes:
            events.setdefault(n, asyncio.Event())
        for n in nodes:
            self._task(self._node(n))

    def _event(self, d: Node) -> asyncio.Event | None:
        """The event of dependency ``d``; None when it needs no waiting: it is before the run, in an iteration
        already reported, or in one a stopping run never starts."""
        if d.t < self.start + self.n_reported or (self.stop is not None and d.t > self.last_spawned):
            return None
        return self.done.setdefault(d.t, {}).setdefault(d, asyncio.Event())

    def _release_unspawned(self) -> None:
        """A stopping run spawns no more iterations: what waits for their nodes goes ahead."""
        for t, events in self.done.items():
            if t > self.last_spawned:
                for ev in events.values():
                    ev.set()

    async def _node(self, n: Node) -> None:
        saved = False  # a save node's checkpoint is committed: a later failed write is the records', not its
        try:
            for d in self._deps(n):
                ev = self._event(d)
                if ev is not None:
                    await ev.wait()
            t0 = time.time()
            if self.on_node is not None:
                self.on_node(n.label, n.t + 1, None)
            if n.kind == "call":
                await self._call(n)
            elif n.kind == "realloc":
                snap = self._is_snapshot(n)
                version = max(self.start, n.t - self.program.staleness) if snap else -1
                rec = self._send(self._realloc_ranks(n), "realloc", n.label, n.t, n.label,
                                 lambda req: protocol.Reallocate(req=req, model=n.name, src_call=n.src,
                                                                 dst_call=n.dst, iteration=n.t, drop_src=not snap,
                                                                 version=version))
                await self._wait_realloc(n, rec)
            elif n.kind in ("offload", "reload"):
                home = self.program.home_call(n.name)
                rec = self._send(self.program.calls[home].ranks, n.kind, n.label, n.t, n.label,
                                 lambda req: protocol.Offload(req=req, model=n.name, call=home,
                                                              to_host=n.kind == "offload", iteration=n.t))
                await self._wait(rec)
            elif n.kind == "save":
                await self._save(n.t)
                saved = True
            elif n.kind == "eval":
                await self._eval(n)
            t1 = time.time()
            self.done[n.t][n].set()
            # The nodes that waited for this one send their requests first (they run up to their first wait
            # while this task yields); the records and the console (metrics.jsonl, TensorBoard, the progress
            # line: 10-30 ms an iteration) come after, not between one call's end and the next one's start.
            await asyncio.sleep(0)
            if self.on_node is not None:
                self.on_node(n.label, n.t + 1, t1 - t0)
            self.trace.add_node(n.label, n.kind, n.t, t0, t1)
            for key, seconds in self._booked(n, t1 - t0):  # a fused pair's time is split (master_fused.py)
                self.node_times[n.t][key] = self.node_times[n.t].get(key, 0.0) + seconds
            self._finished(n.t)
        except RunFailed:
            pass  # already recorded; run() raises it
        except OSError as e:  # the master's own writes: a full disk or a read-only run directory
            if n.kind == "save" and not saved:
                self.fail(f"checkpoint {n.t + 1} could not be written: {os_error_line(e)}")
            else:
                self.fail(f"the run's records could not be written after {n.label} (iteration {n.t + 1}): "
                          f"{os_error_line(e)}")
        except Exception as e:  # noqa: BLE001 - a bug here must stop the run, not hang it
            self.fail(f"master error in {n.label} (iteration {n.t + 1}): {type(e).__name__}: {e}")

    async def _wait_realloc(self, n: Node, rec: RequestRecord) -> None:
        """A reallocation is done for its dependents once the ranks that move bytes and those of the destination
        layout have replied. A rank that only releases its source (a device of a dp-2 train layout whose inference
        layout is the other device) may still run a long request, such as a migrated generation's tail: its worker
        runs requests in order, so its own next request sees the release, and its reply is waited for in the
        background (a failure still stops the run). Waiting for it held a streamed consumer's part 1 behind the
        tail (docs/streaming.md, "Where the fused plans lose time")."""
        r = next(x for x in self.program.reallocs(n.name) if (x.src_call, x.dst_call) == (n.src, n.dst))
        needed = self.program.realloc_movers(r) | set(self.program.calls[n.dst].ranks)
        if set(rec.ranks) <= needed:
            await self._wait(rec)
            return
        early = await asyncio.gather(*(self.futures[rec.req, k] for k in rec.ranks if k in needed))
        if not all(rep.ok for rep in early):
            await self._wait(rec)  # reports the failure
        self._wait_in_background(rec)

    def _realloc_ranks(self, n: Node) -> list[int]:
        return sorted(set(self.program.calls[n.src].ranks) | set(self.program.calls[n.dst].ranks))

    def _finished(self, t: int) -> None:
        self.remaining[t] -= 1
        if self.remaining[t]:
            return
        self.iter_end[t] = time.time()
        # Report iterations in order.
        while (k := self.start + self.n_reported) in self.iter_end:
            begin = self.iter_end.get(k - 1, self.t_start)
            # Iteration k finishes before k - 1 when k - 1's evaluation overlaps k's calls; for the report it
            # ends when both have (its time is then 0), so iteration times stay >= 0 and sum to the wall time.
            self.iter_end[k] = max(self.iter_end[k], begin)
            m = iteration_metrics(k, self.call_stats.pop(k), self.node_times.pop(k), self.iter_end[k] - begin,
                                  self.program.batch_size * self.spec.seq_len, self.graph.headline_calls)
            if self.program.staleness:
                m["staleness"] = self._staleness(k)
            ev = self.eval_stats.pop(k, None)
            if ev and self.eval_calls.scorer:  # scored records (a reward model's held-out pairs): the scorer's sums
                m["eval"] = pair_metrics(ev) if "n_pairs" in ev else ev
            elif ev and ev.get("n_seqs_scored"):  # the reward call's workers make these (context.reward_sums)
                m["eval"] = {"reward": ev["score_sum"] / ev["n_seqs_scored"], "n": int(ev["n_seqs_scored"]),
                             "greedy": self.config.eval.greedy}
            self.n_reported += 1
            self.stats.on_iteration(m, self.iter_end[k])
            with naming(self.paths.metrics), open(self.paths.metrics, "a") as f:
                f.write(json.dumps(m) + "\n")
            write_samples(self.paths.root, k, self.samples.pop(k, {}))
            self.trace.flush()
            self.requests.flush()
            if self.on_iteration is not None:
                self.on_iteration(m)
            del self.remaining[k]
            self.iter_end.pop(k - 1, None)
            self.done.pop(k - 1, None)  # iteration k + 1 waits only on iteration k
            rel = self._send(range(self.n_workers), "release", "release data", k, "release",
                             lambda req, k=k: protocol.ReleaseData(req=req, before_iteration=k + 1))
            self._wait_in_background(rel)
            for c in list(self.cached):
                if c[1] <= k:
                    self.cached.pop(c, None)
                    self.data_meta.pop(c, None)
            self.row_tokens.pop(k, None)
            self._forget_streams(k)
            for c in [c for c in self.row_ranges if c[1] <= k]:
                del self.row_ranges[c]
            nxt = k + self.window
            if nxt < self.end and self.stop is None:
                self._spawn(nxt)
            if self.stop is not None and k == self.last_spawned:
                self.stats.close()
                self._task(self._stop_after(k))
            elif k == self.end - 1:
                self.stats.close()
                self.all_done.set()

    def _staleness(self, k: int) -> dict[str, Any]:
        """How old the parameters were that generated iteration k's samples, in train steps (AReaL's
        staleness: the current version k minus the sample's version), max and mean over the samples."""
        versions = self.versions.pop(k, {})
        if not versions:
            return {}
        lag = {c: k - v for c, v in versions.items()}
        worst = max(lag, key=lag.__getitem__)
        if lag[worst] > self.program.staleness or lag[worst] < 0:  # the schedule's invariant (master_schedule)
            self.fail(f"call {worst} (iteration {k + 1}) generated with parameter version {versions[worst]}: "
                      f"staleness {lag[worst]}, outside 0..{self.program.staleness}")
        n = {c: self.spec.n_seqs(self.graph.call(c)) for c in versions}
        mean = sum(lag[c] * n[c] for c in versions) / sum(n.values())
        return {"max": lag[worst], "mean": mean, "versions": versions}

    def _wait_in_background(self, rec: RequestRecord) -> None:
        """Wait for ``rec``'s replies without holding any node; a failure still stops the run, and the run does
        not end before every such wait has (Master.run), so a failing last reply is never lost."""
        task = asyncio.create_task(self._wait_quietly(rec))
        for tasks in (self.tasks, self.background):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def _task(self, coro: Any) -> None:
        """Run ``coro`` as a task the master cancels at the end; it forgets the task when it finishes."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _call(self, n: Node) -> None:
        c, t = n.name, n.t
        flush_deferred(self, t, *(self.program.fused_partner(c) or (c,)))  # its inputs' waiting transfers first
        if (pair := self.program.fused_partner(c)) is not None:  # one request runs both calls (master_fused.py)
            return await self._fused_call(n, pair)
        if c in self.splits:  # a consumer streamed in two parts around a generation's tail (master_tail.py)
            return await self._call_in_parts(n)
        # The inputs were sent when their producers finished (``_push_outputs``); each worker runs them
        # before this call, which it received later.
        recs = self.pushed.pop((c, t), [])
        ranges = [list(r) for r in self._row_ranges(c, t) or ()]
        rows = [list(r) for r in self._balanced_rows(c, t) or ()]  # balance_tokens: row lists (row_deal.py)
        call = self._send(self.program.calls[c].ranks, "call", c, t, c,
                          lambda req: protocol.RunCall(req=req, call=c, iteration=t, ranges=ranges, rows=rows))
        # dispatched: the later train calls' row lists and transfers once the other ready calls are too
        asyncio.get_running_loop().call_soon(flush_deferred, self, t)
        for rec in recs:
            await self._wait(rec)
        # a generation with a tail entry: its migration point; streaming only: the first part and the second request
        early, call = await self._stream_at_migration(c, t, call) or ([], call)
        replies = await self._wait(call)
        self._balance_part_two(c, t, early + replies)  # balance_tokens: the split consumers' part 2 (master_tail.py)
        self._finish_call(c, t, early + replies)

    def _finish_call(self, c: str, t: int, replies: list[protocol.Reply]) -> None:
        """A call's replies: its stats, data, samples; then its outputs go to their consumers."""
        rpc = self.graph.call(c)
        stats: dict[str, float] = {}
        for rep in replies:
            for k, v in rep.stats.items():  # the version once: a streamed generation's dp rank 0 replies twice
                stats[k] = v if k == "param_version" else stats.get(k, 0.0) + v
            for out in rep.outputs:
                self.data_meta.setdefault((out.key, t), out.tensors)
            for part in rep.samples:
                self.samples.setdefault(t, {}).setdefault((part.key, part.seq), {}).update(part.fields)
            if rep.row_tokens and c == self._balanced_generation():  # a tail's replies name their rows
                self.row_tokens.setdefault(t, {}).update(zip(rep.rows, rep.row_tokens) if rep.rows else
                                                         enumerate(rep.row_tokens, rep.rows_lo))
        if self.program.is_stale(c):
            version = stats.pop("param_version", None)
            if version is None:
                self.fail(f"call {c} (iteration {t + 1}) reported no parameter version")
                raise RunFailed(self.failure)
            self.versions.setdefault(t, {})[c] = int(version)
        missing = [k for k in rpc.output_data if (k, t) not in self.data_meta]
        if missing:
            self.fail(f"call {c} (iteration {t + 1}) produced no data for key {missing[0]!r}")
            raise RunFailed(self.failure)
        self.call_stats[t][c] = stats
        self._push_outputs(c, t)

    def _push_outputs(self, producer: str, t: int) -> None:
        """Dispatch the transfers of ``producer``'s outputs to every consumer now, in topological order.

        A data-transfer node follows its producer in the augmented graph (realhf.txt §4), which is how the
        planner's simulator schedules it. Sent later, with the consumer, a transfer queues behind work
        dispatched in between on the producer's devices, and the consumer's devices wait idle in it.
        """
        produced = set(self.graph.call(producer).output_data)
        for consumer in self.graph.topo_order:
            for key in self.graph.call(consumer).input_data:
                if key in produced and defer_push(self, consumer, t):  # dealt after a dispatch (master_balance.py)
                    self.deferred.setdefault((consumer, t), []).append(key)
                elif key in produced:
                    self.pushed.setdefault((consumer, t), []).extend(self._transfer(key, consumer, t))

    def _transfer(self, key: str, consumer: str, t: int) -> list[RequestRecord]:
        self._row_ranges(consumer, t)  # decided before the transfer: a balanced consumer holds row lists
        if self._streams_rows(key, consumer, t):  # dp ranks holding row lists (master_tail.py)
            return self._transfer_rows(key, consumer, t)
        metas = self.data_meta[(key, t)]
        cached = self.cached.setdefault((key, t), {})
        src = self.program.producer_of(key)
        dst_ranges = self._row_ranges(consumer, t)
        plan = self.program.data_plan(key, consumer, row_bytes(metas), cached={d: list(v) for d, v in cached.items()},
                                      src_ranges=self._row_ranges(src, t) if src else None, dst_ranges=dst_ranges)
        dl = self.program.consumer(consumer)
        ranges = dst_ranges or dp_ranges(self.program.batch_size, dl.strategy.dp)
        for dev, (dp_rank, _, pp_rank) in dl.layout.coords_by_device.items():
            entry = (key, *ranges[dp_rank])
            if entry not in cached.setdefault(dev, []):
                cached[dev].append(entry)
        return self._send_transfer(key, consumer, t, plan, metas)

    def _send_transfer(self, key: str, consumer: str, t: int, plan: TransferPlan,
                       metas: list[protocol.TensorMeta]) -> list[RequestRecord]:
        if not plan.transfers:
            return []
        recs = []
        new = sorted(set(plan.groups) - self.known_groups)
        if new:
            recs.append(self._send(range(self.n_workers), "groups", "create groups", t, consumer,
                                   lambda req: protocol.EnsureGroups(req=req, rank_sets=[list(g) for g in new])))
            self.known_groups.update(new)
        ranks = sorted({x.src for x in plan.transfers} | {d for x in plan.transfers for d in x.dsts})
        pieces = [protocol.Broadcast(src=x.src, dsts=list(x.dsts), lo=x.lo, hi=x.hi) for x in plan.transfers]
        recs.append(self._send(ranks, "data", f"{key} -> {consumer}", t, consumer,
                               lambda req: protocol.TransferData(req=req, key=key, iteration=t, dst_call=consumer,
                                                                 tensors=metas, broadcasts=pieces)))
        return recs

    # -- token-balanced dp ranks (RunConfig.balance_tokens; graph/row_balance.py) ----------------------------------
    def _balanced_generation(self) -> str | None:
        """The generation call whose lengths balance the later calls: the graph's only one (with several, the
        rows' lengths are ambiguous and every call keeps the even split)."""
        gens = [c for c in self.graph.topo_order if self.graph.call(c).interface_type is InterfaceType.GENERATE]
        return gens[0] if self.config.balance_tokens and len(gens) == 1 else None

    def _row_ranges(self, call: str, t: int) -> tuple[tuple[int, int], ...] | None:
        """``call``'s dp ranks' contiguous shares of iteration t's batch; None: the even split, or, once its
        generation reported the tokens (``balance_tokens``), row lists balanced by tokens, which this deals into
        ``row_lists`` (``_balanced_rows``). Decided once per (call, t), so its transfers and its request agree."""
        if (call, t) not in self.row_ranges:
            tokens = self.row_tokens.get(t, {})
            n = self.program.batch_size
            cl, rpc = self.program.calls[call], self.graph.call(call)
            ranges = None
            if (self._balanced_generation() and rpc.interface_type is not InterfaceType.GENERATE
                    and len(tokens) == n and cl.strategy.dp > 1 and (call, t) not in self.row_lists):
                # row lists by tokens per mini-batch (index mod n_minibatches), n_mbs rows of each on every rank
                # (a streamed call's parts are dealt by master_tail.py instead)
                self.balanced[call, t] = self.row_lists[call, t] = deal_rows_cached(
                    self, [tokens[i] for i in range(n)], t, cl.strategy.dp, self.spec.group_size, rpc.n_minibatches,
                    cl.n_mbs)
            self.row_ranges[call, t] = ranges
        return self.row_ranges[call, t]

    def _balanced_rows(self, call: str, t: int) -> tuple[tuple[int, ...], ...] | None:
        """``call``'s dp ranks' row lists when ``balance_tokens`` dealt them (``_row_ranges`` decides)."""
        self._row_ranges(call, t)
        return self.balanced.get((call, t))
