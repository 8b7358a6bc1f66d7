"""An iteration's time minus the workers' compute, from a run's requests.jsonl (``benchmarks/bench_runtime.py``).

An iteration's window runs from the end of the previous iteration's last call, reallocation or transfer (the
first dispatch of the run's first iteration) to the end of its own last one, as the master saw them end (the
replies' arrival). In it:

- ``compute``: the time during which at least one worker runs one of the iteration's model calls;
- ``eval``: in-run evaluation passes (they overlap the next iteration) outside that;
- ``moves``: parameter reallocations, data transfers and offloads outside both;
- ``master``: the rest, no worker busy with any of these: the master's scheduling, messaging, the replies'
  way back and the gaps between one call's end and the next call's start.

``overhead = window - compute`` (eval + moves + master): what a faster runtime could remove without faster
kernels (issue 35 aims at 10% of the demo's iteration). Times are wall-clock on each worker's clock (one machine).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

STEP_KINDS = ("call", "realloc", "data", "offload")  # what belongs to an iteration's window


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _clip(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if min(e, hi) > max(s, lo)]


@dataclasses.dataclass(frozen=True)
class IterationOverhead:
    iteration: int  # counted from 1, as requests.jsonl and the console count
    window: float
    compute: float
    eval: float
    moves: float
    master: float

    @property
    def overhead(self) -> float:
        return self.window - self.compute


def iteration_overheads(records: Iterable[Mapping[str, Any]]) -> list[IterationOverhead]:
    """Per iteration of requests.jsonl's ``records`` (dicts with kind, iteration, dispatched, spans, received):
    its window and how the window splits (module doc)."""
    by_it: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        if r["iteration"] >= 1:
            by_it.setdefault(r["iteration"], []).append(r)
    out = []
    prev_end: float | None = None
    for t in sorted(by_it):
        steps = [r for r in by_it[t] if r["kind"] in STEP_KINDS and r.get("received")]
        if not steps:
            continue
        start = prev_end if prev_end is not None else min(r["dispatched"] for r in steps)
        end = max(max(r["received"].values()) for r in steps)
        prev_end = end

        def spans(kinds: tuple[str, ...]) -> list[tuple[float, float]]:
            # every iteration's requests of these kinds inside the window (a stale or evaluating neighbour counts)
            return _clip([tuple(v) for rs in by_it.values() for r in rs if r["kind"] in kinds
                          for v in r["spans"].values()], start, end)

        compute_spans = spans(("call",))
        compute = union_seconds(compute_spans)
        with_eval = union_seconds(compute_spans + spans(("eval",)))
        busy = union_seconds(compute_spans + spans(("eval",)) + spans(("realloc", "data", "offload")))
        window = end - start
        out.append(IterationOverhead(t, window, compute, with_eval - compute, busy - with_eval, window - busy))
    return out
