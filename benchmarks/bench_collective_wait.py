"""The bounded busy-wait for CPU collectives (``realloc/models/collective_wait.py``, issue 31) against the blocking
wait, interleaved A/B on two gloo processes without a master (docs/estimator.md, "Waits at dp > 1").

Each round runs, once per setting of ``REALLOC_COLLECTIVE_SPIN_MS`` (the order alternating between rounds):

- the train steps of ``bench_fusion.py --setting fit``'s colocated plan at dp 2 (``bench_train_wait.py``'s
  ``_batches``: 2 mini-batches of 16 rows per replica, prompts of 8 tokens, lengths lognormal median 8
  p99 128 from the seeded EOS schedule, packed, the distributed optimizer), for ``tiny`` and ``mid-critic``;
- an 8-byte all-reduce that one rank (by turns) enters 1 ms late after 2 ms of work, timed from the late rank's
  arrival to its end (mean of 30).

It prints per setting the medians over rounds 2.. of the slower replica's wall time, its thread CPU, and the
late all-reduce; beside the wall times the median over rounds of their ratio to the first setting's in the
same round; and the load average.

    .venv/bin/python benchmarks/bench_collective_wait.py [--rounds 8] [--spins 0,3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the gloo process pool of the tests (mp_pool.py)
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_train_wait import MODELS, _batches, _loss  # noqa: E402  the same train steps as bench_train_wait.py

LATE_REPEATS = 30


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _late_all_reduce(rank: int) -> float:
    """Mean time from the late rank's arrival to the end of an 8-byte all-reduce (the late rank by turns)."""
    import torch
    import torch.distributed as dist

    from realloc.models.collective_wait import blocking

    buf = torch.zeros(1, dtype=torch.float64)
    total = 0.0
    for i in range(LATE_REPEATS):
        dist.barrier()
        late = i % 2 == rank
        _busy(0.002 + (0.001 if late else 0.0))
        t0 = time.perf_counter()
        blocking(dist.all_reduce, buf)
        took = torch.tensor([time.perf_counter() - t0 if late else 0.0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        total += float(took)
    return total / LATE_REPEATS


def _rounds(ctx, rounds: int, spins: list[str]) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    from model_helpers import build_model
    from realloc.models.collective_wait import SPIN_ENV
    from realloc.models.config import get_model_config

    torch.set_num_threads(1)
    models = {name: build_model(ctx, get_model_config(name), 2, 1, 1, seed=3) for name in MODELS}
    opts = {name: m.make_optimizer(lr=1e-6) for name, m in models.items()}
    out = []
    for r in range(rounds):
        row: dict[str, float] = {}
        for spin in (spins if r % 2 == 0 else spins[::-1]):
            os.environ[SPIN_ENV] = spin
            for name, m in models.items():
                mbs = _batches(get_model_config(name), r, m.groups.dp_rank)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                for mb in mbs:  # PPO's mini-batches: one train step each
                    m.train_step([mb], _loss, opts[name])
                row[f"{spin} {name} wall"] = time.perf_counter() - t0
                row[f"{spin} {name} cpu"] = time.thread_time() - c0
            row[f"{spin} late"] = _late_all_reduce(ctx.rank)
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--spins", default="0,3", help="REALLOC_COLLECTIVE_SPIN_MS settings to compare, comma separated")
    args = p.parse_args()
    spins = [s.strip() for s in args.spins.split(",")]
    from mp_pool import GlooPool

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, GlooPool(2, Path(tmp)) as pool:
        a, b = pool.run(_rounds, args.rounds, spins, timeout=1800)
    med = statistics.median
    print(f"dp-2 train calls and a late 8-byte all-reduce per REALLOC_COLLECTIVE_SPIN_MS, interleaved, medians over "
          f"rounds 2..{args.rounds}, milliseconds; load average {load:.1f}-{os.getloadavg()[0]:.1f}")
    head = "".join(f"{m + ' wall':>16}{'cpu':>8}" for m in MODELS)
    print(f"{'spin ms':<8}{head}{'late AR':>10}")
    for spin in spins:
        cells = []
        for key in [f"{m} {k}" for m in MODELS for k in ("wall", "cpu")] + ["late"]:
            v = med(max(x[f"{spin} {key}"], y[f"{spin} {key}"]) for x, y in zip(a[1:], b[1:]))
            width = 16 if key.endswith("wall") else (10 if key == "late" else 8)
            # in brackets: the median over rounds of this setting's wall time over the first setting's in the
            # same round (paired: the load drifts between rounds more than within one)
            paired = med(max(x[f"{spin} {key}"], y[f"{spin} {key}"]) / max(x[f"{spins[0]} {key}"],
                                                                         y[f"{spins[0]} {key}"])
                         for x, y in zip(a[1:], b[1:]))
            cells.append(f"{v * 1e3:.1f} ({paired:.2f})" if key != "late" and key.endswith("wall")
                         else f"{v * 1e3:.2f}" if key == "late" else f"{v * 1e3:.1f}")
            cells[-1] = f"{cells[-1]:>{width}}"
        print(f"{spin:<8}{''.join(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
