"""Plain-Python reference of the fused pipeline schedule (csrc/fused_schedule.h), written apart from the
C++ so that tests compare two implementations: an order's makespan and per-device memory, the lower
bound, and every valid order of a tiny problem (brute force).

The evaluation follows rlhfuse.txt Algorithm 3: a pass ends at max(end of the previous pass on its
device, end of its input pass (+ p2p across devices)) + its length, computed here over an explicit
dependency graph in topological order; a cycle is a deadlock.
"""

from __future__ import annotations

import dataclasses
import graphlib
import itertools
from collections.abc import Iterator, Sequence

Pass = tuple[int, int, int]  # (model 0 = A / 1 = B, backward 0/1, micro-batch)
Order = list[list[Pass]]


@dataclasses.dataclass(frozen=True)
class RefModel:
    pp: int
    n_micro: int
    fwd: Sequence[float]
    bwd: Sequence[float]
    act: Sequence[float]


@dataclasses.dataclass(frozen=True)
class RefProblem:
    n_devices: int
    a: RefModel
    b: RefModel
    p2p: float = 0.0

    def model(self, m: int) -> RefModel:
        return self.a if m == 0 else self.b

    def place(self, m: int, device: int) -> tuple[int, int]:
        """(pipe, stage) of model m on a device: A runs up the devices, B down."""
        rank = device if m == 0 else self.n_devices - 1 - device
        return divmod(rank, self.model(m).pp)

    def device(self, m: int, pipe: int, stage: int) -> int:
        rank = pipe * self.model(m).pp + stage
        return rank if m == 0 else self.n_devices - 1 - rank

    def length(self, device: int, p: Pass) -> float:
        m, bw, _ = p
        stage = self.place(m, device)[1]
        return (self.model(m).bwd if bw else self.model(m).fwd)[stage]

    def input_of(self, device: int, p: Pass) -> tuple[int, Pass] | None:
        """The (device, pass) this pass waits for, if any."""
        m, bw, mb = p
        pipe, stage = self.place(m, device)
        if not bw:
            return (self.device(m, pipe, stage - 1), (m, 0, mb)) if stage > 0 else None
        if stage + 1 < self.model(m).pp:
            return self.device(m, pipe, stage + 1), (m, 1, mb)
        return device, (m, 0, mb)


@dataclasses.dataclass(frozen=True)
class RefEval:
    valid: bool
    makespan: float
    device_end: list[float]
    device_peak: list[float]


def pass_times(p: RefProblem, order: Order) -> dict[tuple[int, Pass], tuple[float, float]] | None:
    """(start, end) of every (device, pass) of ``order``, or None if it deadlocks."""
    preds: dict[tuple[int, Pass], list[tuple[tuple[int, Pass], float]]] = {}
    for d, seq in enumerate(order):
        for i, ps in enumerate(seq):
            deps = []
            if i > 0:
                deps.append(((d, seq[i - 1]), 0.0))
            src = p.input_of(d, ps)
            if src is not None:
                deps.append((src, p.p2p if src[0] != d else 0.0))
            preds[(d, ps)] = deps
    try:
        topo = list(graphlib.TopologicalSorter({k: [s for s, _ in v] for k, v in preds.items()}).static_order())
    except graphlib.CycleError:
        return None
    times: dict[tuple[int, Pass], tuple[float, float]] = {}
    for node in topo:
        start = max((times[s][1] + w for s, w in preds[node]), default=0.0)
        times[node] = (start, start + p.length(node[0], node[1]))
    return times


def evaluate(p: RefProblem, order: Order) -> RefEval:
    peaks = []
    for d, seq in enumerate(order):
        cur = peak = 0.0
        for m, bw, _ in seq:
            a = p.model(m).act[p.place(m, d)[1]]
            cur += -a if bw else a
            peak = max(peak, cur)
        peaks.append(peak)
    times = pass_times(p, order)
    if times is None:
        return RefEval(False, float("inf"), [], peaks)
    device_end = [times[(d, seq[-1])][1] if seq else 0.0 for d, seq in enumerate(order)]
    return RefEval(True, max(device_end), device_end, peaks)


def lower_bound(p: RefProblem) -> float:
    """rlhfuse.txt §7.3: per device, earliest first arrival + all its work + shortest tail; also each
    model's own such bound."""
    best = 0.0
    for d in range(p.n_devices):
        arr, tail, work = [], [], []
        for m in (0, 1):
            mod, stage = p.model(m), p.place(m, d)[1]
            arr.append(sum(mod.fwd[:stage]) + stage * p.p2p)
            tail.append(sum(mod.bwd[:stage]) + stage * p.p2p)
            work.append(mod.n_micro * (mod.fwd[stage] + mod.bwd[stage]))
            best = max(best, arr[m] + work[m] + tail[m])
        best = max(best, min(arr) + sum(work) + min(tail))
    return best


def device_orders(n_a: int, n_b: int) -> Iterator[list[Pass]]:
    """Every order of one device's passes that keeps each model's micro-batch order and puts each
    backward after its forward."""
    counts = {0: n_a, 1: n_b}

    def rec(nxt: dict[tuple[int, int], int], prefix: list[Pass]) -> Iterator[list[Pass]]:
        if len(prefix) == 2 * (n_a + n_b):
            yield list(prefix)
            return
        for m, bw in itertools.product((0, 1), (0, 1)):
            mb = nxt[(m, bw)]
            if mb >= counts[m] or (bw and nxt[(m, 0)] <= mb):
                continue
            nxt[(m, bw)] += 1
            prefix.append((m, bw, mb))
            yield from rec(nxt, prefix)
            prefix.pop()
            nxt[(m, bw)] -= 1

    yield from rec({k: 0 for k in itertools.product((0, 1), (0, 1))}, [])


def brute_force(p: RefProblem) -> tuple[float, Order]:
    """The lowest makespan over every valid order (tiny problems only)."""
    per_device = list(device_orders(p.a.n_micro, p.b.n_micro))
    best, best_order = float("inf"), []
    for combo in itertools.product(per_device, repeat=p.n_devices):
        e = evaluate(p, list(combo))
        if e.valid and e.makespan < best:
            best, best_order = e.makespan, list(combo)
    return best, best_order
