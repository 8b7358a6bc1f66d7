"""FlexRLHF Table III at the paper's own batch rule: "the batch size for each experiment is set to the maximum value
before Out of Memory" (flexrlhf-placement.txt, Hyperparameters), the strongest pool alone against the two pools,
by the estimator (docs/heterogeneous.md, "Table III at the paper's batch rule"; no GPU is used).

    .venv/bin/python benchmarks/bench_batch_rule.py --only "Table III"         # ~3 min on a quiet machine
    .venv/bin/python benchmarks/bench_batch_rule.py                             # also H100 + H20 / L40S

Two readings of "before Out of Memory", each with every memory check of the planner (per pool, per kind):
- ``any``: realloc's own space, each call in up to 64 micro-batches. Micro-batches bound a call's activations and
  KV cache by one micro-batch's, so memory does not bound the batch; the table shows samples/s as the batch grows.
- ``one``: one micro-batch per call (``plan_search(max_n_mbs=1)``), as DeepSpeed-Chat runs without gradient
  accumulation: a call's whole batch is on its devices at once, so memory bounds the batch. Frozen models may
  still wait in host memory between their calls (realloc's offload).
- ``resident``: one micro-batch per call and every model kept on its devices (``offload=False``), DeepSpeed-Chat's
  regime: the models that move to the second pool free memory on the first for a larger batch (the mechanism
  FlexRLHF names, §V-A).
For each reading: fixed batches side by side (the same batch on both clusters), then, where memory binds (``one``,
``resident``), the largest batch (a multiple of the setting's step) for which the search finds a plan that fits, on
each cluster, and samples/s at it.
Every point is two searches of ``--search-time`` seconds: the strongest pool alone, and the two pools (which also
searches the strongest pool alone first, and starts from that plan); the A100-only number is the better of the two,
and the two pools' is never above it (the strongest pool's plan is a plan of the two pools, the other idle).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realloc.api import ExperimentSpec, load_experiment  # noqa: E402
from realloc.search.build import NoFitError  # noqa: E402
from realloc.search.planner import plan_search  # noqa: E402
from realloc.search.pool_space import pool_alone, strongest_pool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (title, experiment, batches of the fixed-batch comparison, the step of the largest batch, the paper's numbers)
SETTINGS = (
    ("Table III: 33B PPO, 8 A100 + 8 V100", "experiments/ppo_33b_a100_v100.py", (64, 128, 256, 512), 16,
     "0.69 -> 0.79 samples/s (1.145x)"),
    ("GRPO 8B, 8 H100 + 8 H20 (eta <= 1)", "experiments/grpo_h100_h20.py", (64, 128, 256, 512), 16, "-"),
    ("GRPO 8B, 8 H100 + 8 L40S (eta <= 1)", "experiments/grpo_h100_l40s.py", (64, 128, 256, 512), 16, "-"),
)
READINGS = {"any": (None, True), "one": (1, True), "resident": (1, False)}  # -> max_n_mbs, offload


@dataclasses.dataclass(frozen=True)
class Point:
    """One batch on both clusters: seconds per iteration (None: no plan fits) and the samples of an iteration."""

    batch: int
    samples: int
    alone: float | None
    both: float | None

    def rate(self, t: float | None) -> str:
        return f"{self.samples / t:.3f}" if t else "OOM"

    def ratio(self) -> str:
        return f"{self.alone / self.both:.3f}x" if self.alone and self.both else "-"


def search_time(spec: ExperimentSpec, seconds: float, reading: str, seed: int) -> tuple[float | None, ...]:
    """(the strongest pool alone, the two pools) s/iteration at ``spec``'s batch; None where no plan fits."""
    max_n_mbs, offload = READINGS[reading]
    alone = None
    try:
        alone = plan_search(pool_alone(spec, strongest_pool(spec.cluster)), seconds, seed=seed,
                            max_n_mbs=max_n_mbs, offload=offload).plan.estimated_time
    except NoFitError:
        pass
    try:
        report = plan_search(spec, seconds, seed=seed, max_n_mbs=max_n_mbs, offload=offload)
    except NoFitError:
        return alone, None
    inner = report.alone.plan.estimated_time if report.alone is not None else None
    best_alone = min((t for t in (alone, inner) if t is not None), default=None)
    # the strongest pool's plan is a plan of the two pools (the other pool idle): a time-limited search that found
    # a slower two-pool plan than the separate search of the strongest pool takes that plan
    return best_alone, min(report.plan.estimated_time, best_alone or float("inf"))


def summary(points: dict[int, Point], big: dict[str, int | None] | None, step: int, paper: str) -> str:
    """The paper's rule (each cluster at its own largest batch), and each cluster at its best samples/s over the
    batches tried."""
    def rate(p: Point | None, k: str) -> float | None:
        t = p and getattr(p, k)
        return p.samples / t if t else None

    def line(name: str, a: Point | None, b: Point | None) -> str:
        ra, rb = rate(a, "alone"), rate(b, "both")
        ratio = f"{rb / ra:.3f}x" if ra and rb else "-"
        return (f"{name}: strongest pool alone at batch {a and a.batch}: {ra and f'{ra:.3f}'} samples/s; two pools at "
                f"batch {b and b.batch}: {rb and f'{rb:.3f}'} samples/s; {ratio} (paper: {paper})")

    best = {k: max((p for p in points.values() if getattr(p, k)), key=lambda p: rate(p, k), default=None)
            for k in ("alone", "both")}
    out = [line("best samples/s over the batches tried", best["alone"], best["both"])]
    if big is not None:
        out.insert(0, line(f"paper's rule (the largest batch that fits, step {step})",
                           points.get(big["alone"]), points.get(big["both"])))
    return "\n".join(out)


def largest(fits, step: int, start: int, cap: int) -> int | None:
    """The largest multiple of ``step`` up to ``cap`` with ``fits(b)``, doubling from ``start`` and then bisecting
    (fitting is taken to be monotone in the batch: a larger batch needs no less memory)."""
    lo, hi = None, None
    b = start
    while b <= cap:
        if fits(b):
            lo, b = b, 2 * b
        else:
            hi = b
            break
    if lo is None:
        b = start - step
        while b >= step and not fits(b):
            b -= step
        return b if b >= step else None
    hi = hi or cap + step
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search-time", type=float, default=6.0, help="seconds of each search")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="the settings whose title contains this text")
    ap.add_argument("--readings", default="any,one,resident",
                    help="any (micro-batches as the search likes), one (one each), resident (one, no offload)")
    ap.add_argument("--cap", type=int, default=2048, help="the largest batch tried for the largest batch")
    args = ap.parse_args()
    t0 = time.perf_counter()
    for title, path, batches, step, paper in SETTINGS:
        if args.only and args.only not in title:
            continue
        base = load_experiment(str(ROOT / path))
        for reading in args.readings.split(","):
            cache: dict[int, Point] = {}

            def point(b: int) -> Point:
                if b not in cache:
                    spec = dataclasses.replace(base, batch_size=b)
                    alone, both = search_time(spec, args.search_time, reading, args.seed)
                    cache[b] = Point(b, b * spec.group_size, alone, both)
                    print(f"  [{title} | {reading} | batch {b}: {cache[b].alone} / {cache[b].both} s/it;"
                          f" {time.perf_counter() - t0:.0f} s]", flush=True)
                return cache[b]

            print(f"\n{title}; reading {reading}; paper {paper}")
            print(f"{'batch':>6}{'samples':>9}{'alone s/it':>12}{'samples/s':>11}{'two pools s/it':>16}"
                  f"{'samples/s':>11}{'ratio':>9}")
            for b in batches:
                point(b)
            big = None
            if reading != "any":
                big = {k: largest(lambda b, k=k: getattr(point(b), k) is not None, step, batches[0], args.cap)
                       for k in ("alone", "both")}
            for p in sorted(cache.values(), key=lambda p: p.batch):  # every batch searched, the bisection's too
                print(f"{p.batch:>6}{p.samples:>9}{p.alone or float('nan'):>12.2f}{p.rate(p.alone):>11}"
                      f"{p.both or float('nan'):>16.2f}{p.rate(p.both):>11}{p.ratio():>9}")
            print(summary(cache, big, step, paper))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
