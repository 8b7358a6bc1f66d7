"""What a run records: per-iteration metrics (JSONL) and a Chrome-trace timeline of every device.

The trace has one row per device (model worker) with a box for every request it executed:
calls, reallocations, data transfers, offloads, checkpoints. Open it in ``chrome://tracing`` or
https://ui.perfetto.dev next to the search's estimated timeline. A "master" row shows, per
dispatched node, the span from dispatch to the last reply.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Iterable

HEADLINE = ("reward", "kl", "actor_loss", "critic_loss")


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
            ready = max(dispatched, prev_end)
            out.append(max(0.0, s - ready) + max(0.0, received - e))
            prev_end = e
    return out


class Trace:
    def __init__(self, n_devices: int, device_names: list[str], t0: float) -> None:
        """``t0``: wall-clock time zero, before any request (else a participant that started a request
        before the one whose span was recorded first would get a negative timestamp)."""
        self.events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0,
                                               "args": {"name": "devices"}},
                                              {"name": "process_name", "ph": "M", "pid": 1,
                                               "args": {"name": "master"}}]
        for r in range(n_devices):
            self.events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                                "args": {"name": f"device {r} ({device_names[r]})"}})
            self.events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
        self.t0 = t0

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def add(self, rec: RequestRecord) -> None:
        for rank, (s, e) in sorted(rec.spans.items()):
            self.events.append({"name": rec.label, "cat": rec.kind, "ph": "X", "pid": 0, "tid": rank,
                                "ts": self._us(s), "dur": round((e - s) * 1e6, 1),
                                "args": {"iteration": iteration_number(rec.iteration), "req": rec.req}})

    def add_node(self, name: str, kind: str, iteration: int, start: float, end: float) -> None:
        self.events.append({"name": name, "cat": kind, "ph": "X", "pid": 1, "tid": 0, "ts": self._us(start),
                            "dur": round((end - start) * 1e6, 1), "args": {"iteration": iteration_number(iteration)}})

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".part")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        tmp.replace(path)


def iteration_number(t: int) -> int:
    """What users see: iterations count from 1 (console, metrics.jsonl, trace, checkpoints); 0 marks
    requests outside any iteration (setup, shutdown). Internally iteration ``t`` counts from 0."""
    return t + 1 if t >= 0 else 0


def iteration_metrics(iteration: int, call_stats: dict[str, dict[str, float]], node_times: dict[str, float],
                      iteration_time: float, tokens: int) -> dict[str, Any]:
    """One JSONL record: headline PPO numbers, per-call stats, and time per call (incl. reallocation)."""
    merged: dict[str, float] = {}
    for stats in call_stats.values():
        for k, v in stats.items():
            merged[k] = merged.get(k, 0.0) + v
    out: dict[str, Any] = {"iteration": iteration_number(iteration)}
    if merged.get("n_seqs_scored"):
        out["reward"] = merged["score_sum"] / merged["n_seqs_scored"]
    for k in ("kl", "actor_loss", "critic_loss", "approx_kl", "actor_clip_frac", "critic_clip_frac",
              "actor_grad_norm", "critic_grad_norm", "value_mean", "return_mean", "adv_abs_mean", "actor_lr",
              "critic_lr"):
        if k in merged:
            out[k] = merged[k]
    out["iteration_time"] = iteration_time
    out["tokens_per_s"] = tokens / iteration_time if iteration_time > 0 else 0.0
    out["time"] = dict(node_times)
    out["calls"] = call_stats
    return out


def format_line(m: dict[str, Any], total: int) -> str:
    parts = [f"iter {m['iteration']}/{total}"]
    for k in HEADLINE:
        if k in m:
            parts.append(f"{k} {m[k]:+.4f}" if k != "reward" else f"{k} {m[k]:.4f}")
    times = " ".join(f"{n} {t:.2f}s" for n, t in m["time"].items())
    parts.append(times)
    parts.append(f"{m['iteration_time']:.2f}s/it {m['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def overhead_summary(records: Iterable[RequestRecord]) -> dict[str, float]:
    recs = [r for r in records if r.kind in ("call", "realloc", "data") and r.completed]
    ov = dispatch_overheads(recs)
    if not ov:
        return {}
    return {"requests": float(len(recs)), "mean_overhead_s": statistics.fmean(ov),
            "median_overhead_s": statistics.median(ov)}


def device_time_shares(records: Iterable[RequestRecord], n_devices: int, begin: float, end: float) -> dict[str, float]:
    """Share of all devices' time in [begin, end] spent per request kind (the rest is idle).

    realhf.txt §8.2 reports reallocation at 2.2% of GPU time measured this way.
    """
    span = (end - begin) * n_devices
    out: dict[str, float] = {}
    if span <= 0:
        return out
    for r in records:
        for s, e in r.spans.values():
            busy = min(e, end) - max(s, begin)
            if busy > 0:
                out[r.kind] = out.get(r.kind, 0.0) + busy / span
    out["idle"] = max(0.0, 1.0 - sum(out.values()))
    return out


def run_summary(metrics: list[dict[str, Any]], records: list[RequestRecord], n_devices: int,
                iter_end: dict[int, float], warmup: int = 1) -> dict[str, Any]:
    """Steady-state numbers of a run: iterations after ``warmup`` (start-up and first-call effects excluded)."""
    if not metrics:
        return {}
    steady = metrics[warmup:] or metrics
    first = steady[0]["iteration"] - 1  # iter_end is keyed by the internal, 0-based iteration
    begin = iter_end.get(first - 1, iter_end[first] - steady[0]["iteration_time"])
    end = iter_end[steady[-1]["iteration"] - 1]
    times = [m["iteration_time"] for m in steady]
    out: dict[str, Any] = {
        "iterations": len(metrics), "steady_iterations": len(steady),
        "iteration_time": statistics.fmean(times), "iteration_time_median": statistics.median(times),
        "tokens_per_s": statistics.fmean(m["tokens_per_s"] for m in steady),
        "device_time_shares": device_time_shares(records, n_devices, begin, end),
        "overhead": overhead_summary(records),
        "first_reward": metrics[0].get("reward"), "last_reward": metrics[-1].get("reward"),
    }
    return out
