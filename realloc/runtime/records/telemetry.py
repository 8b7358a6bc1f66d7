"""What a run records: per-iteration metrics (JSONL) and a Chrome-trace timeline of every device.

The trace has one row per device (model worker) with a box for every request it executed:
calls, reallocations, data transfers, offloads, checkpoints. Open it in ``chrome://tracing`` or
https://ui.perfetto.dev next to the search's estimated timeline. A "master" row shows, per
dispatched node, the span from dispatch to the last reply.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Collection, Iterable

from realloc.atomic_file import write_text_atomically
from realloc.runtime.records.run_paths import NamedFile, naming

HEADLINE = ("reward", "kl", "actor_loss", "critic_loss", "dpo_loss", "dpo_accuracy", "sft_loss", "rm_loss",
            "rm_accuracy")


@dataclasses.dataclass
class RequestRecord:
    """One request as the master saw it, with each participant's own start/end (wall clock)."""

    req: int
    kind: str  # call | realloc | data | offload | save | groups | setup | release | shutdown
    label: str
    iteration: int
    node: str  # the scheduling node the request belongs to
    dispatched: float
    ranks: tuple[int, ...] = ()
    completed: float = 0.0
    spans: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)  # rank -> (start, end)
    received: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> when its reply arrived
    # rank -> device memory of the request on a GPU: {"peak_bytes", "allocated_bytes"} (torch.cuda counters)
    memory: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def worker_time(self) -> float:
        """Longest execution on any participant."""
        return max((e - s for s, e in self.spans.values()), default=0.0)



def dispatch_overheads(records: Iterable[RequestRecord]) -> list[float]:
    """Per request and participant: the master's share of the latency, excluding work and queueing.

    A request waits on a worker behind the requests sent to it earlier; that wait is the plan's,
    not the master's. What remains is the time from when the worker could have started (dispatch,
    or the end of its previous request) to its start, plus the time from its end until the master
    had the reply: messaging, serialization and the master's own scheduling.
    """
    by_rank: dict[int, list[tuple[float, float, float, float]]] = {}
    for r in records:
        for rank, (s, e) in r.spans.items():
            if rank in r.received:
                by_rank.setdefault(rank, []).append((s, e, r.dispatched, r.received[rank]))
    out = []
    for rows in by_rank.values():
        rows.sort()
        prev_end = float("-inf")
        for s, e, dispatched, received in rows:
            out.append(dispatch_overhead(dispatched, prev_end, s, e, received))
            prev_end = e
    return out


def dispatch_overhead(dispatched: float, prev_end: float, start: float, end: float, received: float) -> float:
    """One reply's share of ``dispatch_overheads``: ``prev_end`` ends the worker's previous request."""
    return max(0.0, start - max(dispatched, prev_end)) + max(0.0, received - end)


TRACE_HEAD = '{"displayTimeUnit": "ms", "traceEvents": [\n'
RESUME_GAP = 1.0  # seconds of trace time between a resumed session and the events before it


class Trace:
    """The Chrome trace, written to ``path`` as the run goes (the master keeps no events in memory).

    The JSON object is closed by ``close()``; ``flush()`` after each iteration puts everything so far
    on disk, so a killed master leaves all but the closing brackets.

    A resumed run (``resume_after``: the iterations its checkpoint holds) keeps the earlier sessions' events
    of those iterations and of none (set-up, shutdown), drops the later ones (this run does them again), and
    continues the timeline ``RESUME_GAP`` after the last kept event, with a marker where it resumed.
    """

    def __init__(self, path: Path, n_devices: int, device_names: list[str], t0: float,
                 resume_after: int | None = None) -> None:
        """``t0``: wall-clock time zero, before any request (else a participant that started a request
        before the one whose span was recorded first would get a negative timestamp)."""
        kept = _earlier_events(path, resume_after) if resume_after is not None else []
        self._f = NamedFile(path, "w")
        self._f.write(TRACE_HEAD)
        self._first = True
        self.t0 = t0
        if kept:
            for ev in kept:
                self._event(ev)
            end = max(ev.get("ts", 0.0) + ev.get("dur", 0.0) for ev in kept) / 1e6
            self.t0 = t0 - end - RESUME_GAP  # this session's events follow the kept ones
            self._event({"name": f"resumed after iteration {resume_after}", "ph": "i", "s": "g", "pid": 1, "tid": 0,
                         "ts": round((end + RESUME_GAP / 2) * 1e6, 1)})
        self._event({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "devices"}})
        self._event({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "master"}})
        for r in range(n_devices):
            self._event({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                         "args": {"name": f"device {r} ({device_names[r]})"}})
            self._event({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})

    def _event(self, ev: dict[str, Any]) -> None:
        self._f.write(("" if self._first else ",\n") + json.dumps(ev))
        self._first = False

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def add(self, rec: RequestRecord) -> None:
        for rank, (s, e) in sorted(rec.spans.items()):
            self._event({"name": rec.label, "cat": rec.kind, "ph": "X", "pid": 0, "tid": rank,
                         "ts": self._us(s), "dur": round((e - s) * 1e6, 1),
                         "args": {"iteration": iteration_number(rec.iteration), "req": rec.req,
                                  **{f"{k}_gib": round(v / 2**30, 3) for k, v in rec.memory.get(rank, {}).items()}}})

    def add_node(self, name: str, kind: str, iteration: int, start: float, end: float) -> None:
        self._event({"name": name, "cat": kind, "ph": "X", "pid": 1, "tid": 0, "ts": self._us(start),
                     "dur": round((end - start) * 1e6, 1),
                     "args": {"iteration": iteration_number(iteration)}})

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.write("\n]}\n")
            self._f.close()


def _earlier_events(path: Path, resume_after: int) -> list[dict[str, Any]]:
    """The duration events of an earlier session's trace that a run resumed after iteration ``resume_after``
    keeps. The file is read line by line (one event a line), so a trace a killed master left unclosed, or
    whose last line it was writing, still gives every complete event."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip().rstrip(",")
        if not line.startswith("{") or line.startswith('{"displayTimeUnit"'):
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("ph") == "M":
            continue  # names of processes and rows: this session writes them again
        if ev.get("ph") == "i" or ev.get("args", {}).get("iteration", 0) <= resume_after:
            out.append(ev)
    # An earlier resume's marker stays only if the events before it do (not when this run resumes from further back).
    end = max((ev.get("ts", 0.0) + ev.get("dur", 0.0) for ev in out if ev.get("ph") != "i"), default=0.0)
    return [ev for ev in out if ev.get("ph") != "i" or ev.get("ts", 0.0) <= end]


class RequestLog:
    """``requests.jsonl``: one line per request with its per-worker spans and reply arrival times, written
    when the request completes (and, at the end, for requests that never did).

    Each line carries its ``session``: 1 for a fresh run; a run resumed after iteration ``resume_after`` keeps
    the earlier sessions' lines of those iterations and of none (set-up, shutdown), drops the later ones (this
    run does them again) and appends its own as the next session (``join_sessions`` draws them end to end)."""

    def __init__(self, path: Path, resume_after: int | None = None) -> None:
        self.session = 1
        if resume_after is not None and path.is_file():
            kept = []
            for line in path.read_text(errors="replace").splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the half-written last line of a killed master
                if isinstance(r, dict) and r.get("iteration", 0) <= resume_after:
                    kept.append(line)
                    self.session = max(self.session, int(r.get("session", 1)) + 1)
            with naming(path):  # a new file renamed over it: a kill or a full disk midway keeps the old one
                write_text_atomically(path, "".join(line + "\n" for line in kept))
            self._f = NamedFile(path, "a")
        else:
            self._f = NamedFile(path, "w")

    def write(self, r: RequestRecord) -> None:
        self._f.write(json.dumps({"req": r.req, "session": self.session, "kind": r.kind, "label": r.label,
                                  "iteration": iteration_number(r.iteration),
                                  "dispatched": r.dispatched, "completed": r.completed,
                                  "spans": {str(k): v for k, v in r.spans.items()},
                                  "received": {str(k): v for k, v in r.received.items()},
                                  **({"memory": {str(k): v for k, v in r.memory.items()}} if r.memory else {})})
                      + "\n")

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def join_sessions(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """requests.jsonl's lines with each resumed session's times moved back so that its first iteration's
    requests start where the previous session's last iteration ended (wall-clock time between them, worker
    start-up included, is not the plan's), for drawing iterations from before and after a resume together."""
    by_session: dict[int, list[dict[str, Any]]] = {}
    for r in requests:
        by_session.setdefault(int(r.get("session", 1)), []).append(r)
    out: list[dict[str, Any]] = []
    prev_end: float | None = None
    for session in sorted(by_session):
        rows = by_session[session]
        spans = [tuple(v) for r in rows if r.get("iteration", 0) > 0 for v in r.get("spans", {}).values()]
        shift = 0.0
        if prev_end is not None and spans:
            shift = min(s for s, _ in spans) - prev_end
        for r in rows:
            out.append(_shifted(r, shift) if shift else r)
        if spans:
            prev_end = max(e for _, e in spans) - shift
    return out


def _shifted(r: dict[str, Any], by: float) -> dict[str, Any]:
    return {**r, "dispatched": r["dispatched"] - by, "completed": r["completed"] - by if r.get("completed") else 0.0,
            "spans": {k: [s - by, e - by] for k, (s, e) in r.get("spans", {}).items()},
            "received": {k: t - by for k, t in r.get("received", {}).items()}}


def iteration_number(t: int) -> int:
    """What users see: iterations count from 1 (console, metrics.jsonl, trace, checkpoints); 0 marks
    requests outside any iteration (setup, shutdown). Internally iteration ``t`` counts from 0."""
    return t + 1 if t >= 0 else 0


HEADLINE_STATS = ("kl", "actor_loss", "critic_loss", "approx_kl", "k3_kl", "actor_clip_frac", "critic_clip_frac",
                  "actor_grad_norm", "critic_grad_norm", "value_mean", "return_mean", "adv_abs_mean", "actor_lr",
                  "critic_lr", "dpo_loss", "dpo_accuracy", "dpo_margin", "chosen_reward", "rejected_reward", "sft_loss",
                  "rm_loss", "rm_accuracy", "rm_margin", "rm_chosen", "rm_rejected", "rm_grad_norm", "rm_lr")


def iteration_metrics(iteration: int, call_stats: dict[str, dict[str, float]], node_times: dict[str, float],
                      iteration_time: float, tokens: int, headline: Collection[str] | None = None) -> dict[str, Any]:
    """One JSONL record: headline numbers, per-call stats, and time per call (incl. reallocation).

    ``reward``, ``response_len`` and ``eos_frac`` come from the ``headline`` calls (``DataflowGraph.headline_calls``;
    all when None); another call that scores sequences is reported as ``reward_<call>``."""
    merged: dict[str, float] = {}
    for call, stats in call_stats.items():
        side = headline is not None and call not in headline
        if side and stats.get("n_seqs_scored"):
            merged[f"reward_{call}"] = stats["score_sum"] / stats["n_seqs_scored"]
        for k, v in stats.items():
            if side and k in ("score_sum", "n_seqs_scored", "gen_tokens", "n_seqs", "eos_stops"):
                continue
            merged[k] = merged.get(k, 0.0) + v
    out: dict[str, Any] = {"iteration": iteration_number(iteration)}
    if merged.get("n_seqs_scored"):
        out["reward"] = merged["score_sum"] / merged["n_seqs_scored"]
    if merged.get("n_seqs"):  # generation: mean response length and the share that stopped at EOS
        out["response_len"] = merged.get("gen_tokens", 0.0) / merged["n_seqs"]
        out["eos_frac"] = merged.get("eos_stops", 0.0) / merged["n_seqs"]
    for k in HEADLINE_STATS + tuple(sorted(k for k in merged if k.startswith("reward_"))):
        if k in merged:
            out[k] = merged[k]
    out["iteration_time"] = iteration_time
    out["tokens"] = tokens
    # None when the iteration finished together with the previous one (its work overlapped that one's).
    out["tokens_per_s"] = tokens / iteration_time if iteration_time > 0 else None
    out["time"] = dict(node_times)
    out["calls"] = call_stats
    return out


def format_line(m: dict[str, Any], total: int) -> str:
    parts = [f"iter {m['iteration']}/{total}"]
    for k in HEADLINE:
        if k in m:
            parts.append(f"{k} {m[k]:+.4f}" if k != "reward" else f"{k} {m[k]:.4f}")
    if "eval" in m and "rm_accuracy" in m["eval"]:  # a reward model's held-out pairs
        parts.append(f"eval rm_accuracy {m['eval']['rm_accuracy']:.4f} rm_loss {m['eval']['rm_loss']:.4f}")
    elif "eval" in m:
        parts.append(f"eval reward {m['eval']['reward']:.4f} ({'greedy' if m['eval']['greedy'] else 'sampled'})")
    if m.get("staleness"):  # bounded staleness: how many train steps behind the samples' parameters were
        parts.append(f"staleness {m['staleness']['max']} (mean {m['staleness']['mean']:.2f})")
    times = " ".join(f"{n} {t:.2f}s" for n, t in m["time"].items())
    parts.append(times)
    if m["tokens_per_s"] is None:
        # Its last node ended before the previous iteration's did (generation running ahead, an evaluation of
        # the previous iteration still going): it took no wall time of its own.
        parts.append("0 s of its own: done before the previous iteration finished (its work overlapped it)")
    else:
        parts.append(f"{m['iteration_time']:.2f}s/it {m['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


class LogHistogram:
    """Counts of positive values in bins 1% wide (from 1 us), for quantiles in constant memory."""

    RATIO = 1.01
    LOW = 1e-6

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.n = 0

    def add(self, x: float) -> None:
        b = -1 if x < self.LOW else int(math.log(x / self.LOW, self.RATIO))
        self.counts[b] = self.counts.get(b, 0) + 1
        self.n += 1

    def quantile(self, q: float) -> float:
        """The value at quantile ``q``, within 1%; 0 for values under 1 us."""
        rank, seen = q * (self.n - 1), 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen > rank:
                return 0.0 if b < 0 else self.LOW * self.RATIO ** (b + 0.5)
        return 0.0


class RunStats:
    """The numbers of ``summary.json``, accumulated as replies and iterations arrive (constant memory).

    Steady state excludes the first ``warmup`` iterations: device time counts from the end of the last
    warm-up iteration to the end of the last iteration, clipped per span. With no iteration past the
    warm-up, the whole run counts.
    """

    def __init__(self, n_devices: int, warmup: int = 1) -> None:
        self.n_devices = n_devices
        self.warmup = warmup
        self.begin: dict[str, float | None] = {"all": None, "steady": None}
        self.busy: dict[str, dict[str, float]] = {"all": {}, "steady": {}}
        self.end = 0.0
        self.closed = False
        self.prev_end: dict[int, float] = {}
        self.overhead = LogHistogram()
        self.overhead_sum = 0.0
        # (iteration time, tokens/s) per iteration: two floats each, the only per-iteration state kept
        self.times: dict[str, list[tuple[float, float]]] = {"all": [], "steady": []}
        self.first: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.n_iterations = 0
        self.stale: list[float] = []  # bounded staleness: [largest, sum of the per-iteration means, iterations]

    def on_reply(self, kind: str, rank: int, dispatched: float, start: float, end: float, received: float) -> None:
        """One worker's reply. Replies of one worker arrive in its execution order."""
        if self.closed:
            return
        for window, begin in self.begin.items():
            busy = end - max(start, begin) if begin is not None else 0.0
            if busy > 0:
                self.busy[window][kind] = self.busy[window].get(kind, 0.0) + busy
        if kind in ("call", "realloc", "data"):
            ov = dispatch_overhead(dispatched, self.prev_end.get(rank, float("-inf")), start, end, received)
            self.prev_end[rank] = end
            self.overhead.add(ov)
            self.overhead_sum += ov

    def start(self, t: float) -> None:
        """The iterations begin (device time before, e.g. set-up, does not count)."""
        self.begin["all"] = self.end = t

    def on_iteration(self, m: dict[str, Any], end: float) -> None:
        self.n_iterations += 1
        self.first = self.first or m
        self.last = m
        self.end = end
        st = m.get("staleness") or {}
        if st:
            worst, total, n = self.stale or [0.0, 0.0, 0.0]
            self.stale = [max(worst, st["max"]), total + st["mean"], n + 1]
        row = (m["iteration_time"], m["tokens"])
        self.times["all"].append(row)
        if self.n_iterations > self.warmup:
            self.times["steady"].append(row)
        elif self.n_iterations == self.warmup:
            self.begin["steady"] = end

    def close(self) -> None:
        """No more device time counts (the iterations are over; what follows is shutdown)."""
        self.closed = True

    def summary(self) -> dict[str, Any]:
        if not self.n_iterations:
            return {}
        window = "steady" if self.times["steady"] else "all"
        rows, begin = self.times[window], self.begin[window]
        times = [t for t, _ in rows]
        span = (self.end - begin) * self.n_devices
        shares = {k: v / span for k, v in self.busy[window].items()} if span > 0 else {}
        if span > 0:
            shares["idle"] = max(0.0, 1.0 - sum(shares.values()))
        overhead = {}
        if self.overhead.n:
            overhead = {"requests": float(self.overhead.n), "mean_overhead_s": self.overhead_sum / self.overhead.n,
                        "median_overhead_s": self.overhead.quantile(0.5)}
        return {"iterations": self.n_iterations, "steady_iterations": len(times),
                "iteration_time": statistics.fmean(times), "iteration_time_median": statistics.median(times),
                "tokens_per_s": sum(n for _, n in rows) / sum(times) if sum(times) > 0 else None,
                "device_time_shares": shares,
                "overhead": overhead,
                "first_reward": self.first.get("reward"), "last_reward": self.last.get("reward"),
                **({"staleness": {"max": int(self.stale[0]), "mean": self.stale[1] / self.stale[2]}}
                   if self.stale else {})}
