"""Measure collectives among N processes and fit ``seconds = alpha + beta * bytes`` (worker side of ``realloc profile``).

Ops: broadcast, all-reduce and all-gather over the group's first ``n`` ranks,
and a p2p send/recv between its first two. Message sizes grow by x4 from 4 B to
``max_bytes`` (per-rank input size). Each point: one untimed run, then
``repeats`` runs, each timed as the slowest rank of the group after a barrier;
the median is kept. The fit minimizes the relative error, so the latency
(alpha, set by the small messages) and the bandwidth (beta, set by the large
ones) are both honoured.

All processes of a profiling run live on this machine, so every fit is of
link kind ``intra``; ``CommModel`` applies it to ``inter`` too when the cluster
says its two link kinds have the same bandwidth (local process "nodes").
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

OPS = ("broadcast", "all_reduce", "all_gather", "p2p")


def message_sizes(max_bytes: int) -> list[int]:
    out, n = [], 4
    while n <= max_bytes:
        out.append(n)
        n *= 4
    return out


def _op_runner(op: str, group: dist.ProcessGroup, ranks: Sequence[int], nbytes: int) -> Callable[[], None]:
    me = dist.get_rank()
    n = len(ranks)
    numel = max(nbytes // 4, 1)
    buf = torch.ones(numel, dtype=torch.float32)
    if op == "broadcast":
        return lambda: dist.broadcast(buf, src=ranks[0], group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        out = torch.empty(numel * n, dtype=torch.float32)
        return lambda: dist.all_gather_into_tensor(out, buf, group=group)
    if op == "p2p":
        if me == ranks[0]:
            return lambda: dist.send(buf, dst=ranks[1])
        if me == ranks[1]:
            return lambda: dist.recv(buf, src=ranks[0])
        return lambda: None
    raise ValueError(f"unknown collective {op!r}")


def time_collective(op: str, group: dist.ProcessGroup, ranks: Sequence[int], nbytes: int, repeats: int) -> float:
    """Median seconds of one ``op`` over ``ranks`` (every rank of ``group`` must call this)."""
    run = _op_runner(op, group, ranks, nbytes)
    run()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(t.tolist())


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, beta) >= 0 minimizing sum(((alpha + beta x - t) / t)^2) over (x, t) points."""
    # Weighted least squares with weights 1/t^2: solve the 2x2 normal equations.
    sw = swx = swxx = swt = swxt = 0.0
    for x, t in points:
        w = 1.0 / (t * t)
        sw += w
        swx += w * x
        swxx += w * x * x
        swt += w * t
        swxt += w * x * t
    det = sw * swxx - swx * swx
    if det <= 0:
        x, t = points[-1]
        return 0.0, t / x if x else 0.0
    alpha = (swt * swxx - swx * swxt) / det
    beta = (sw * swxt - swx * swt) / det
    if beta < 0:
        return statistics.median(t for _, t in points), 0.0
    if alpha < 0:
        # no latency term: beta alone through the origin, same weighting
        return 0.0, sum(x / t for x, t in points) / sum((x / t) ** 2 for x, t in points)
    return alpha, beta
