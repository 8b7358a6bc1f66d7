"""Measure collectives among N processes and fit ``seconds = alpha + beta * bytes`` (worker side of ``realloc profile``).

Ops: broadcast, all-reduce and all-gather over the group's first ``n`` ranks,
and a p2p send/recv between its first two (and an all-reduce entered late, ``time_late_all_reduce``, below).
Message sizes grow by x4 from 4 B to ``max_bytes`` (per-rank input size). Each point: one untimed run, then
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

OPS = ("broadcast", "all_reduce", "all_gather", "p2p")  # fitted alpha + beta * bytes (LATE_OP below: its mean)


def message_sizes(max_bytes: int) -> list[int]:
    out, n = [], 4
    while n <= max_bytes:
        out.append(n)
        n *= 4
    return out


def _device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives take their tensors: NCCL's on this process's GPU, gloo's on the CPU."""
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the collective's kernel has ended


def _op_runner(op: str, group: dist.ProcessGroup, ranks: Sequence[int], nbytes: int) -> Callable[[], None]:
    me = dist.get_rank()
    n = len(ranks)
    numel = max(nbytes // 4, 1)
    buf = torch.ones(numel, dtype=torch.float32, device=_device(group))
    if op == "broadcast":
        return lambda: dist.broadcast(buf, src=ranks[0], group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        out = torch.empty(numel * n, dtype=torch.float32, device=buf.device)
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
    device = _device(group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=device)
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


# A blocking all-reduce entered late (docs/estimator.md, "Waits at dp > 1"). A train step's dp collectives follow
# each rank's own compute, so one rank reaches them first and waits for the other; on a CPU cluster an idle core
# that waited can take milliseconds to wake (an idle vCPU halts at once, and the kernel ticks every 4 ms), far more
# than the back-to-back latency the fits above measure after a barrier. Measured as such a step has it: every rank
# computes LATE_COMPUTE_S, one of them (by turns) LATE_BY_S longer, then an 8-byte all-reduce.
LATE_OP = "all_reduce_late"
LATE_BYTES = 8
LATE_COMPUTE_S = 2e-3
LATE_BY_S = 1e-3


def _busy(seconds: float, a: torch.Tensor) -> None:
    """Compute (small matmuls) for ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        torch.mm(a, a)


def time_late_all_reduce(group: dist.ProcessGroup, ranks: Sequence[int], repeats: int) -> float:
    """Mean seconds from the last rank's arrival at an 8-byte all-reduce entered late (above) to its end on the
    slowest rank: what the collective adds to the makespan of the ranks' work before it. The mean, not the median:
    the slow wake-ups are a share of the runs, and a train step pays that share."""
    me, device = list(ranks).index(dist.get_rank()), _device(group)
    buf, a = torch.zeros(max(LATE_BYTES // 4, 1), dtype=torch.float32, device=device), torch.ones(32, 32)
    dist.all_reduce(buf, group=group)  # warm-up: connections, buffers
    arrive, end = [], []
    for i in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        _busy(LATE_COMPUTE_S + (LATE_BY_S if i % len(ranks) == me else 0.0), a)
        arrive.append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for every process of the machine
        dist.all_reduce(buf, group=group)
        _sync(device)
        end.append(time.perf_counter())
    t = torch.tensor([arrive, end], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return statistics.fmean((t[1] - t[0]).tolist())
