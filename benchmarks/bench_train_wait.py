"""Where a train call waits at dp 2 (issue 31; docs/estimator.md, "Waits at dp > 1"), on two gloo processes
without a master.

``bench_fusion.py --setting fit``'s colocated plan trains the actor (``tiny``) and the critic (``mid-critic``) at dp 2
over both devices; on a quiet machine their train calls took 57 and 91 ms of wall time against 32 and 67 ms of CPU.
This runs the same train steps (2 mini-batches of 16 rows per replica, prompts of 8 tokens, lengths lognormal median
8 p99 128 from the seeded EOS schedule, packed; the distributed optimizer) round after round, and prints per model,
medians over rounds 2..:

- wall and thread CPU of the call on the slower replica, and their difference, the wait;
- ``imbalance``: the wait two replicas with these CPU times would have if every collective cost nothing (their CPU
  segments between collectives replayed in lockstep): the share of the wait that unequal work explains;
- the blocking dp collectives of the call (counted) and their wall time;
- ``late extra``: the all-reduce entered late (``profile_collectives.time_late_all_reduce``, what ``realloc
  profile`` stores as ``all_reduce_late``) less the back-to-back one, measured in the same rounds, and that times
  the collectives: the wait the estimator prices (``CommModel.late_extra``) from a profile made here and now.

    .venv/bin/python benchmarks/bench_train_wait.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the gloo process pool of the tests (mp_pool.py)
ROWS, PROMPT, GEN_LEN, MEDIAN, N_MBS = 32, 8, 128, 8, 2
MODELS = ("tiny", "mid-critic")
BLOCKING = ("all_reduce", "reduce_scatter_single", "all_gather_single")


def _batches(cfg, t: int, dp_rank: int) -> list[dict]:
    """This replica's 2 mini-batches of iteration ``t``: the scheduled lengths, rows dealt in turn."""
    import torch

    from realloc.lengths import ResponseLengths
    from realloc.models.length_schedule import scheduled_lengths
    from realloc.models.weights import param_seed

    lens = scheduled_lengths(ResponseLengths.lognormal(median=MEDIAN, p99=GEN_LEN), GEN_LEN,
                             param_seed(1, f"generate/{t}"), range(ROWS))
    mine = [PROMPT + n for i, n in enumerate(lens) if i % 2 == dp_rank]
    g = torch.Generator().manual_seed(t)
    out = []
    for k in range(N_MBS):
        rows = torch.tensor(mine[k::N_MBS])
        width = int(rows.max())
        ids = torch.randint(1, min(cfg.vocab_size, 64), (len(rows), width), generator=g)
        mask = torch.arange(width)[None] < rows[:, None]
        out.append({"input_ids": ids * mask, "lengths": rows, "targets": torch.randn(len(rows), width, generator=g),
                    "critic": cfg.is_critic})
    return out


def _loss(out, mb):
    import torch

    if mb["critic"]:  # the critic: a value loss over the real tokens
        valid = (out.layout.segment_ids >= 0).float()
        return (((out.values - mb["targets"]) ** 2) * valid).sum() / valid.sum(), {}
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / torch.clamp(mask.sum(), min=1), {}


def _rounds(ctx, rounds: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    from model_helpers import build_model
    from realloc.estimator.profile_collectives import time_collective, time_late_all_reduce
    from realloc.models.config import get_model_config

    torch.set_num_threads(1)
    models = {name: build_model(ctx, get_model_config(name), 2, 1, 1, seed=3) for name in MODELS}
    opts = {name: m.make_optimizer(lr=1e-6) for name, m in models.items()}
    events: list[tuple[float, float]] = []  # (thread CPU at entry, thread CPU in it) of each blocking collective
    walls: list[float] = []
    saved = {n: getattr(dist, n) for n in BLOCKING}

    def timed(name):
        def run(*a, **k):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return saved[name](*a, **k)
            finally:
                events.append((c0, time.thread_time() - c0))
                walls.append(time.perf_counter() - t0)
        return run

    group = dist.new_group([0, 1])
    out = []
    for r in range(rounds):
        row: dict[str, float] = {}
        for name, m in models.items():
            mbs = _batches(get_model_config(name), r, m.groups.dp_rank)
            events.clear()
            walls.clear()
            for n in BLOCKING:
                setattr(dist, n, timed(n))
            try:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                for mb in mbs:  # PPO's mini-batches: one train step each
                    m.train_step([mb], _loss, opts[name])
                row[f"{name} wall"], c1 = time.perf_counter() - t0, time.thread_time()
            finally:
                for n, f in saved.items():
                    setattr(dist, n, f)
            row[f"{name} cpu"] = c1 - c0
            # CPU segments between collectives (from the call's start to the first, ..., the last to the end)
            marks = [c0] + [x for e in events for x in (e[0], e[0] + e[1])] + [c1]
            row[f"{name} segments"] = [b - a for a, b in zip(marks[::2], marks[1::2])]
            row[f"{name} collectives"], row[f"{name} coll wall"] = len(events), sum(walls)
        row["late"] = time_late_all_reduce(group, (0, 1), 30)
        row["back to back"] = time_collective("all_reduce", group, (0, 1), 8, 30)
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    import os

    from mp_pool import GlooPool

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, GlooPool(2, Path(tmp)) as pool:
        got = pool.run(_rounds, args.rounds, timeout=1800)
    a, b = got
    med = statistics.median
    late = [max(0.0, x["late"] - x["back to back"]) for x in a[1:]]
    print(f"train calls at dp 2 (2 mini-batches of 16 rows per replica, the fit setting's lengths), medians over "
          f"rounds 2..{args.rounds}, milliseconds; load average {load:.1f}-{os.getloadavg()[0]:.1f}")
    print(f"late all-reduce {med(x['late'] for x in a[1:]) * 1e3:.3f}, back to back "
          f"{med(x['back to back'] for x in a[1:]) * 1e3:.3f}: late extra {med(late) * 1e3:.3f} per collective")
    print(f"{'model':<12}{'wall':>8}{'cpu':>8}{'wait':>8}{'imbalance':>10}{'colls':>6}{'coll wall':>10}"
          f"{'late x colls':>13}")
    for name in MODELS:
        walls = [max(x[f"{name} wall"], y[f"{name} wall"]) for x, y in zip(a[1:], b[1:])]
        cpus = [max(x[f"{name} cpu"], y[f"{name} cpu"]) for x, y in zip(a[1:], b[1:])]
        # lockstep replay: each segment ends when the slower replica's does
        lock = [sum(map(max, x[f"{name} segments"], y[f"{name} segments"]))
                - max(sum(x[f"{name} segments"]), sum(y[f"{name} segments"])) for x, y in zip(a[1:], b[1:])]
        n = a[-1][f"{name} collectives"]
        wait = med(w - c for w, c in zip(walls, cpus))
        print(f"{name:<12}{med(walls) * 1e3:8.1f}{med(cpus) * 1e3:8.1f}{wait * 1e3:8.1f}{med(lock) * 1e3:10.1f}{n:6d}"
              f"{med(x[f'{name} coll wall'] for x in a[1:]) * 1e3:10.1f}{med(late) * n * 1e3:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
