"""A worker's side of a generation call with a long-tail migration (``ExecutionPlan.tail``; docs/streaming.md).

Every dp replica of the call runs this inside the same ``RunCall`` request:

1. The interface function runs once with a stand-in model that records its ``generate`` call (prompts, sampling
   config, sequence ids, micro-batches) and stops it there.
2. Phase 1 (``models/tail_decode.decode_until``): the replica decodes its rows; the replicas sum their unfinished
   rows per step over the dp group (asynchronous all-reduces of a few steps' counts each, ``AsyncCounts``: no
   replica waits for the others at every step), and the migration point is the first step where the whole call has at most R_t left.
   A replica that decoded past it takes its unfinished rows back to it.
3. Migration: one all-gather over the dp group carries rows -- each with its inputs, prompt, tokens and log-probs so
   far -- the tail rows of every replica to replicas 0..m-1, the finished rows of replicas 0..m-1 to the freed
   replicas m..dp-1 (``graph/streaming.generation_shares``).
4. A freed replica runs the interface function on the finished rows it holds, with a stand-in model that returns
   their generation results, and replies: the master streams these rows to the calls on the freed devices while
   replicas 0..m-1 run phase 2 -- decoding to the end from the tail rows' KV caches, sent to them point to point
   after the all-gather (``tail_kv.py``, ``models/kv_move.py``), or after a re-run prefill
   (``tail_decode.continue_decoding``) where the plan's ``kv`` says "prefill" -- and then the interface function on
   their tail rows.

The interface function must call ``model.generate`` once with one sequence id per input row, in row order (the
built-in generation interfaces do). If no step ends with 1..R_t rows left (the last rows end together), there is no
migration: every replica finishes its own rows as without the tail entry.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.graph.streaming import deal
from realloc.graph.tail import TailMigration
from realloc.models import collective_wait
from realloc.models.generation import GenerationOutput, _concat, _prompt_list, assemble
from realloc.models.sampling import GenerationConfig
from realloc.models.tail_decode import PhaseOne, TailRows, continue_decoding, decode_until, select_rows
from realloc.runtime.control.tail_kv import exchange, moved_phase_two
from realloc.runtime.transfer.data_store import pack_rows, row_bytes, unpack_rows
from realloc.runtime.wire.protocol import TensorMeta

log = logging.getLogger("realloc.worker")


class _Clock:
    """Wall seconds of a migrating generation's phases on this replica, for the worker's log (where the fused
    plan spends its time: docs/streaming.md, "Where the time goes")."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.cpu_last = time.thread_time()
        self.parts: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # this thread's CPU seconds of each part (benchmarks/bench_tail_phases.py)

    def lap(self, name: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.last
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu - self.cpu_last
        self.last, self.cpu_last = now, cpu

    def report(self, call: str, dp_rank: int, **extra: Any) -> None:
        text = ", ".join(f"{k} {v:.3f} s" for k, v in self.parts.items())
        more = "".join(f", {k} {v}" for k, v in extra.items())
        log.info("%s tail dp rank %d: %s%s", call, dp_rank, text, more)


class GenerateCaptured(Exception):
    """Raised by the recording stand-in to stop the interface function at its generate call."""


@dataclasses.dataclass
class _GenerateArgs:
    prompts: list[torch.Tensor]
    gconfig: GenerationConfig
    seq_ids: list[int]
    n_mbs: int


class GenerateRecorder:
    """The model as the interface function sees it on its first run: ``generate`` records its arguments."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.args: _GenerateArgs | None = None

    def generate(self, prompts: Any, gconfig: GenerationConfig, seq_ids: Sequence[int] | None = None,
                 n_mbs: int = 1, max_in_flight: int | None = None) -> GenerationOutput:
        rows = _prompt_list(prompts)
        ids = list(range(len(rows))) if seq_ids is None else [int(i) for i in seq_ids]
        self.args = _GenerateArgs(rows, gconfig, ids, n_mbs)
        raise GenerateCaptured

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def captured_generate(ctx: CallContext, fn: Callable, inputs: Data, call: str) -> _GenerateArgs:
    """Run the interface function ``fn`` up to its ``model.generate`` call and return that call's arguments (a
    tail entry's generation decodes them itself); one error if the function cannot be run that way."""
    rec = GenerateRecorder(ctx.model)
    try:
        fn(dataclasses.replace(ctx, model=rec), inputs)
    except GenerateCaptured:
        pass
    if rec.args is None:
        raise ValueError(f"call {call!r}: its interface never called model.generate, so its 'tail' plan entry "
                         f"cannot run; drop the entry")
    if rec.args.seq_ids != list(ctx.ids):
        raise ValueError(f"call {call!r}: with a 'tail' plan entry the generation interface must generate one "
                         f"sequence per input row, with seq_ids=ctx.ids")
    return rec.args


class GenerateReplay:
    """The model on the interface function's second run: ``generate`` returns results made already, once."""

    def __init__(self, model: Any, out: GenerationOutput, ids: list[int], call: str) -> None:
        self._model, self._out, self._ids, self._call = model, out, ids, call

    def generate(self, prompts: Any, gconfig: GenerationConfig, seq_ids: Sequence[int] | None = None,
                 n_mbs: int = 1, max_in_flight: int | None = None) -> GenerationOutput:
        if self._out is None or seq_ids is None or [int(i) for i in seq_ids] != self._ids:
            raise ValueError(f"call {self._call!r}: with a 'tail' plan entry the generation interface must call "
                             f"model.generate once, with one sequence id per input row in row order (ctx.ids); "
                             f"drop the call's tail entry to run this interface")
        out, self._out = self._out, None
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


# -- rows on the wire: inputs, prompt, generated tokens and log-probs, one flat row each -----------------------------
def _row_table(inputs: Data, pos: Sequence[int], prompts: list[torch.Tensor], ids: Sequence[int],
               tokens: torch.Tensor, logprobs: torch.Tensor, glen: Sequence[int], eos: Sequence[bool],
               width: int, n_new: int) -> dict[str, torch.Tensor]:
    idx = torch.tensor(list(pos), dtype=torch.long)
    n = len(pos)
    table = {f"in/{role}/{name}": t.index_select(0, idx) for role, d in inputs.items() for name, t in d.items()}
    prompt = torch.zeros((n, width), dtype=torch.long)
    if n:  # right-padded with zeros to the call's widest prompt
        flat = torch.nn.utils.rnn.pad_sequence([p.cpu() for p in prompts], batch_first=True)
        prompt[:, :flat.shape[1]] = flat
    tok = torch.zeros((n, n_new), dtype=torch.long)
    lp = torch.zeros((n, n_new), dtype=torch.float32)
    tok[:, :tokens.shape[1]], lp[:, :logprobs.shape[1]] = tokens.cpu(), logprobs.cpu()
    table.update({"id": torch.tensor(list(ids), dtype=torch.long).view(n),
                  "plen": torch.tensor([p.numel() for p in prompts], dtype=torch.long).view(n),
                  "prompt": prompt, "tok": tok, "lp": lp, "glen": torch.tensor(list(glen), dtype=torch.long).view(n),
                  "eos": torch.tensor(list(eos), dtype=torch.bool).view(n)})
    return table


def _metas(table: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name=k, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape[1:]))
            for k, t in sorted(table.items())]


def _gather(table: dict[str, torch.Tensor], group: Any, dp: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Every replica's rows, concatenated in dp-rank order (all-gather of the packed rows)."""
    metas = _metas(table)
    n = int(table["id"].shape[0])
    counts = torch.zeros(dp, dtype=torch.long, device=device)
    counts_in = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_gather_into_tensor(counts, counts_in, group=group)
    cap, width = int(counts.max()), row_bytes(metas)
    buf = torch.zeros(cap * width, dtype=torch.uint8)
    if n:
        buf[:n * width] = pack_rows(table, metas)
    out = torch.empty(dp * cap * width, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(out, buf.to(device), group=group)
    out = out.cpu()
    parts = [unpack_rows(out[k * cap * width:(k * cap + int(counts[k])) * width], metas, int(counts[k]))
             if int(counts[k]) else {name: t[:0] for name, t in table.items()} for k in range(dp)]
    return {name: torch.cat([p[name] for p in parts]) for name in table}


COUNT_WINDOW = 4  # decode steps per count reduction (below)


class AsyncCounts:
    """The whole call's unfinished rows per phase-1 step, as asynchronous all-reduces over the dp group
    (``tail_decode.StepCounts``): a replica posts its count after each step and decodes on; it waits only when it
    has nothing left to decode. One reduction carries the counts of ``window`` consecutive steps and a done marker
    (steps 0..w-1, w..2w-1, ...: the same windows on every replica, so the reductions pair up): a reduction per
    step cost each replica a gloo round trip per decode step, and under load the counts fell a hundred steps behind
    the decoding (docs/streaming.md, "A longer batch"). The migration point is still the first step whose count is
    at most R_t; a replica learns it up to ``window`` - 1 steps later, and phase 1 takes back what it decoded past
    it. A replica with nothing left to decode sends its open window at once, the steps it has not posted yet as 0
    (its count from now on), and skips those posts. Once a replica knows the migration point it stops posting
    counts, but replicas stop at different windows, and gloo pairs collectives by their order: so ``close`` posts
    done markers (waiting for each) until one reduction carries every replica's marker. Then every replica has
    issued the same collectives and the group is free for the all-gather."""

    def __init__(self, group: Any, dp: int, window: int = COUNT_WINDOW) -> None:
        self.group, self.dp, self.window = group, dp, window
        self.pending: collections.deque = collections.deque()
        self.open: list[int] = []  # this replica's counts of the current window, not sent yet
        self.covered = 0  # posts a window sent early already covers (as 0)
        self.posted = self.waits = 0
        self.waited = 0.0

    def _issue(self, counts: list[int], done: int) -> None:
        buf = torch.tensor([*counts, done], dtype=torch.long)
        self.pending.append((dist.all_reduce(buf, group=self.group, async_op=True), buf))
        self.posted += 1

    def _take(self) -> torch.Tensor:
        work, buf = self.pending.popleft()
        if not work.is_completed():
            t0 = time.perf_counter()
            collective_wait.finish(work)  # CPU counts only (gloo): a bounded busy-wait, then wait()
            self.waits, self.waited = self.waits + 1, self.waited + time.perf_counter() - t0
        else:
            work.wait()
        return buf

    def post(self, local: int) -> None:
        if self.covered:  # sent early as 0: this replica has had nothing to decode since
            assert local == 0, local
            self.covered -= 1
            return
        self.open.append(local)
        if len(self.open) == self.window:
            self._issue(self.open, 0)
            self.open = []

    def ready(self, block: bool) -> list[int]:
        if block and self.open:  # nothing left to decode here: the window's later steps count 0 rows
            self.covered = self.window - len(self.open)
            self._issue(self.open + [0] * self.covered, 0)
            self.open = []
        out: list[int] = []
        while self.pending and (self.pending[0][0].is_completed() or (block and not out)):
            out += self._take()[:-1].tolist()
        return out

    def close(self) -> None:
        while self.pending:  # counts of steps past the migration point: the others' collectives pair with them
            self._take()
        while True:
            self._issue([0] * self.window, 1)
            if int(self._take()[-1]) == self.dp:
                return

    def describe(self) -> str:
        return f"{self.posted} reductions, {self.waits} waited for in {self.waited:.3f} s"


def _select(table: dict[str, torch.Tensor], ids: Sequence[int]) -> dict[str, torch.Tensor]:
    where = {int(i): r for r, i in enumerate(table["id"].tolist())}
    idx = torch.tensor([where[int(i)] for i in ids], dtype=torch.long)
    return {k: t.index_select(0, idx) for k, t in table.items()}


def _unpack_inputs(table: dict[str, torch.Tensor]) -> Data:
    out: Data = {}
    for k, t in table.items():
        if k.startswith("in/"):
            _, role, name = k.split("/", 2)
            out.setdefault(role, {})[name] = t
    return out


def _prompts(table: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [table["prompt"][r, :int(p)] for r, p in enumerate(table["plen"].tolist())]


def _output(table: dict[str, torch.Tensor], pad: int) -> GenerationOutput:
    """The generation results of finished rows of ``table``."""
    plen, glen = table["plen"], table["glen"]
    seqs, lps = assemble(table["prompt"], plen, table["tok"], table["lp"], glen, pad)
    return GenerationOutput(seqs, plen + glen, plen.clone(), lps, table["eos"].clone())


def _responses(out: GenerationOutput, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's generated tokens and their log-probs, left-aligned in ``n_new`` columns."""
    seqs, lps = out.sequences.cpu(), out.logprobs.cpu()
    if not seqs.shape[1]:
        return torch.zeros((seqs.shape[0], n_new), dtype=torch.long), torch.zeros((seqs.shape[0], n_new))
    p, g = out.prompt_lengths.cpu().view(-1, 1), (out.lengths - out.prompt_lengths).cpu().view(-1, 1)
    col = torch.arange(n_new).view(1, -1)
    at, valid = (p + col).clamp(max=seqs.shape[1] - 1), col < g  # one gather, not a loop over rows
    return torch.where(valid, seqs.gather(1, at), 0), torch.where(valid, lps.float().gather(1, at), 0.0)


def _replay(ctx: CallContext, fn: Callable[[CallContext, Data], CallResult], table: dict[str, torch.Tensor],
            out: GenerationOutput, call: str) -> CallResult:
    """The interface function on ``table``'s rows, its generate call answered with ``out``."""
    ids = [int(i) for i in table["id"].tolist()]
    return fn(dataclasses.replace(ctx, ids=ids, model=GenerateReplay(ctx.model, out, ids, call)), _unpack_inputs(table))


def _phase_two(model: Any, one: PhaseOne, ahead_ids: list[int], mine: dict[str, torch.Tensor],
               gconfig: GenerationConfig, n_mbs: int) -> GenerationOutput:
    """This tail replica's rows ``mine`` decoded to their end, in their order: those it finished itself while it
    ran ahead of phase 1's counts as they are (``PhaseOne.ahead``), the others after a re-run prefill."""
    ids = [int(i) for i in mine["id"].tolist()]
    kept = {i: r for r, i in enumerate(ahead_ids) if i in set(ids)}
    redo = [r for r, i in enumerate(ids) if i not in kept]
    outs, order = [], []
    if kept:
        outs.append(select_rows(one.ahead_output, list(kept.values())))
        order += list(kept)
    if redo:
        steps = one.tail.steps
        sub = {n: t.index_select(0, torch.tensor(redo, dtype=torch.long)) for n, t in mine.items()}
        rows = TailRows([ids[r] for r in redo], _prompts(sub), sub["tok"][:, :steps], sub["lp"][:, :steps])
        outs.append(continue_decoding(model, rows, gconfig, n_mbs))
        order += rows.seq_ids
    both = outs[0] if len(outs) == 1 else _concat(outs, gconfig.pad_token_id)
    where = {i: r for r, i in enumerate(order)}
    return select_rows(both, [where[i] for i in ids])


def _moving_columns(finished: dict[str, torch.Tensor], running: dict[str, torch.Tensor], one: PhaseOne,
                    pos: list[int], k: int, n_new: int) -> None:
    """The columns a migration that moves KV caches adds to the rows (``tail_kv.py``): each row's replica, whether
    phase 1 finished it ahead of the counts (its whole results then replace its tokens so far: nothing is decoded
    again) and the width of its micro-batch's cache layout."""
    n = len(pos)
    finished.update(src=torch.full((len(finished["id"]),), k, dtype=torch.long),
                    fin=torch.zeros(len(finished["id"]), dtype=torch.bool),
                    wid=torch.zeros(len(finished["id"]), dtype=torch.long))
    ahead = {p: r for r, p in enumerate(one.ahead)}
    running.update(src=torch.full((n,), k, dtype=torch.long),
                   fin=torch.tensor([p in ahead for p in pos], dtype=torch.bool).view(n),
                   wid=torch.tensor([one.held[p][2] if p in one.held else 0 for p in pos], dtype=torch.long).view(n))
    if ahead:
        assert one.ahead_output is not None
        tok, lp = _responses(one.ahead_output, n_new)
        out = one.ahead_output
        for r, p in enumerate(pos):
            if p in ahead:
                a = ahead[p]
                running["tok"][r], running["lp"][r] = tok[a], lp[a]
                running["glen"][r] = out.lengths[a] - out.prompt_lengths[a]
                running["eos"][r] = out.stopped_at_eos[a]


def migrating_generation(ctx: CallContext, fn: Callable[[CallContext, Data], CallResult], inputs: Data,
                         tail: TailMigration, call: str) -> tuple[CallResult | None, list[int]]:
    """Run generation call ``call``'s interface ``fn`` on this dp replica with the tail migration ``tail``; the
    result covers the rows this replica holds at its end (ascending), which it returns beside it (None and no
    rows: a tail replica that got none of the tail)."""
    model = ctx.model
    assert model is not None
    g = model.groups
    a = captured_generate(ctx, fn, inputs, call)
    dev = model.device
    clock = _Clock()
    counts = AsyncCounts(g.dp_group, g.dp)
    one = decode_until(model, a.prompts, a.gconfig, a.seq_ids, a.n_mbs, counts, tail.rows)
    clock.lap("phase 1")
    if one.step < 0:  # no step left 1..R_t rows (the last ones ended together): as without the tail entry
        return fn(dataclasses.replace(ctx, model=GenerateReplay(model, one.output, a.seq_ids, call)), inputs), a.seq_ids
    n_new = a.gconfig.max_new_tokens
    width = torch.tensor([max(p.numel() for p in a.prompts)], dtype=torch.long, device=dev)
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=g.dp_group)
    tok, lp = _responses(one.output, n_new)
    finished = _row_table(inputs, one.finished, [a.prompts[i] for i in one.finished],
                          [a.seq_ids[i] for i in one.finished], tok, lp, one.output.gen_lengths.tolist(),
                          one.output.stopped_at_eos.tolist(), int(width.item()), n_new)
    finished["tail"] = torch.zeros(len(one.finished), dtype=torch.bool)
    t_rows = one.tail
    pos = [a.seq_ids.index(i) for i in t_rows.seq_ids]
    running = _row_table(inputs, pos, t_rows.prompts, t_rows.seq_ids, t_rows.tokens, t_rows.logprobs,
                         [t_rows.steps] * len(pos), [False] * len(pos), int(width.item()), n_new)
    running["tail"] = torch.ones(len(pos), dtype=torch.bool)
    m, dp, k = tail.instances, g.dp, g.dp_rank
    if tail.moves_kv:
        _moving_columns(finished, running, one, pos, k, n_new)
    # replicas 0..m-1 send their finished rows to the freed ones; every replica sends its tail rows
    sent = {n: torch.cat([finished[n], running[n]]) if k < m else running[n] for n in finished}
    clock.lap("rows packed")
    everyone = _gather(sent, g.dp_group, dp, dev)
    clock.lap("all-gather")
    ids = everyone["id"].tolist()
    tails = deal([i for i, t in zip(ids, everyone["tail"].tolist()) if t], m)
    caches = exchange(model, one, a.seq_ids, everyone, tails) if tail.moves_kv else {}
    one.held.clear()  # phase 1's caches: only the rows' cut slots this replica decodes on are still needed
    if tail.moves_kv:
        clock.lap("caches moved")
    if k >= m:  # a freed replica: its own finished rows and its deal of those of replicas 0..m-1
        moved = deal([i for i, t in zip(ids, everyone["tail"].tolist()) if not t], dp - m)[k - m]
        got = _select(everyone, moved)
        table = {n: torch.cat([finished[n], got[n]]) for n in finished}
        held = sorted(int(i) for i in table["id"].tolist())
        table = _select(table, held)
        res = _replay(ctx, fn, table, _output(table, a.gconfig.pad_token_id), call)
        clock.lap("replay")
        clock.report(call, k, step=one.step, counts=counts.describe())
        return res, held
    mine = _select(everyone, tails[k])  # a tail replica: decode its deal of the tail to the end
    if not tails[k]:  # fewer tail rows than tail replicas
        return None, []
    ids = [int(i) for i in mine["id"].tolist()]
    if tail.moves_kv:
        fin = [int(i) for i, f in zip(ids, mine["fin"].tolist()) if f]
        done = _output(_select(mine, fin), a.gconfig.pad_token_id) if fin else None
        out = moved_phase_two(model, one, mine, caches, done, a.gconfig, a.n_mbs)
    else:
        out = _phase_two(model, one, [a.seq_ids[i] for i in one.ahead], mine, a.gconfig, a.n_mbs)
    clock.lap("phase 2")
    res = _replay(ctx, fn, mine, out, call)
    clock.lap("replay")
    clock.report(call, k, step=one.step, counts=counts.describe(), rows=len(ids),
                 kept=len(set(ids) & {a.seq_ids[i] for i in one.ahead}))
    return res, ids
