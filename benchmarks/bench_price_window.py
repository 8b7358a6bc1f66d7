"""The planner's priced window (docs/search.md, "The price of a plan") against a long run, and its cost.

    .venv/bin/python benchmarks/bench_price_window.py                 # both sections, a few minutes on a quiet machine
    .venv/bin/python benchmarks/bench_price_window.py --only accuracy

1. accuracy: random problems of the simulator tests (random graphs, placements, costs; half of them with
   generation running ahead, staleness 1-3), one random plan each, priced by each window and by a long run of 64
   iterations (the first 8 left out, 48 iterations priced). Exact: within 1e-9 of the long run.
2. speed: the same problems as bench_search.py's speed section (the searched plan's space, plans one call away from
   it), priced by the old window (4 iterations, (T_4 - T_1) / 3) and by the new one (10 iterations, (T_8 - T_2) / 6),
   in turns in one process: simulator evaluations per CPU second, C++ against the Python reference, and the MCMC's
   evaluated plans per CPU second (one chain of 3 replicas, early rejection on).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from realloc.search import reference  # noqa: E402
from realloc.search.problem import SearchProblem  # noqa: E402

LONG = 64


def _ends(p: SearchProblem, plan: np.ndarray, n: int) -> np.ndarray:
    """T_1 .. T_n of ``plan`` over ``n`` unrolled iterations (no window: the whole schedule)."""
    ends = np.zeros(n)
    for r in dataclasses.replace(p, n_iterations=n, warmup=0, lookahead=0).to_cpp().schedule(plan):
        ends[r[3]] = max(ends[r[3]], r[5])
    return ends


def windows(eta: int) -> dict[str, tuple[int, int, int]]:
    """Name -> (unrolled iterations, first priced, last priced), 1-based like T_t."""
    e = 3 * eta
    return {"(T4 - T1)/3 over 4 + 3eta, no lookahead (before)": (4 + e, 1, 4 + e),
            "(T7 - T1)/6, lookahead 2": (9 + e, 1, 7 + e),
            "(T8 - T2)/6 (+3eta), lookahead 2 (now)": (10 + e, 2 + e, 8 + e),
            "(T14 - T2)/12 (+3eta), lookahead 2": (16 + e, 2 + e, 14 + e)}


def bench_accuracy(n_problems: int) -> None:
    from test_async_simulator import _with_staleness
    from test_simulator import random_plan, random_problem

    rng = np.random.default_rng(7)
    errors: dict[tuple[bool, str], list[float]] = {}
    for i in range(n_problems):
        p = random_problem(rng)
        if i % 2:
            p = _with_staleness(rng, p)
        plan = random_plan(rng, p)
        long = _ends(p, plan, LONG)
        ref = (long[55] - long[7]) / 48
        if ref <= 0:
            continue
        for name, (n, first, last) in windows(p.staleness).items():
            ends = _ends(p, plan, n)
            price = (ends[last - 1] - ends[first - 1]) / (last - first)
            errors.setdefault((p.staleness > 0, name), []).append(abs(price / ref - 1))
    print(f"\n== 1. windows against a {LONG}-iteration run, {n_problems} random problems ==")
    print(f"{'window':<52}{'graphs':>10}{'exact':>8}{'> 1% off':>10}{'> 5% off':>10}{'mean off':>10}")
    for (stale, name), e in sorted(errors.items(), key=lambda kv: (kv[0][0], list(windows(0)).index(kv[0][1]))):
        e = np.asarray(e)
        print(f"{name:<52}{'run-ahead' if stale else 'sync':>10}{np.mean(e < 1e-9):>8.1%}{np.mean(e > 0.01):>10.1%}"
              f"{np.mean(e > 0.05):>10.1%}{e.mean():>10.1%}")


def bench_speed() -> None:
    from bench_search import mcmc_rate, search_space, speed_cases

    print("\n== 2. cost of the window: old (4 iterations) against new (10), same problems, in turns ==")
    rows = []
    load = os.getloadavg()[0]
    for label, path in speed_cases():
        report, space, plans = search_space(path, 20_000)
        new = space.problem
        old = dataclasses.replace(new, n_iterations=4 + 3 * new.staleness, warmup=0, lookahead=0)
        problems = {"old": old.to_cpp(), "new": new.to_cpp()}
        sim: dict[str, list[float]] = {k: [] for k in problems}
        mcmc: dict[str, list[float]] = {k: [] for k in problems}
        for _ in range(2):  # in turns; the faster run counts (other processes only slow a run down)
            for k, cpp in problems.items():
                t = time.process_time()
                cpp.evaluate_batch(plans)
                sim[k].append(len(plans) / (time.process_time() - t))
                mcmc[k].append(mcmc_rate(None, cpp, report.indices, evals_per_replica=50_000)[0])
        py = {}
        for k, sp in (("old", old), ("new", new)):
            t = time.process_time()
            for row in plans[:100]:
                reference.evaluate(sp, row)
            py[k] = 100 / (time.process_time() - t)
        rows.append((label, {k: max(v) for k, v in sim.items()}, {k: max(v) for k, v in mcmc.items()}, py))
    load = max(load, os.getloadavg()[0])
    print(f"{'graph / cluster':<26}{'sim old/s':>11}{'sim new/s':>11}{'new/old':>9}{'C++/Py old':>12}"
          f"{'C++/Py new':>12}{'MCMC old/s':>12}{'MCMC new/s':>12}{'new/old':>9}")
    for label, s, m, py in rows:
        print(f"{label:<26}{s['old']:>11,.0f}{s['new']:>11,.0f}{s['new'] / s['old']:>9.2f}{s['old'] / py['old']:>11.0f}x"
              f"{s['new'] / py['new']:>11.0f}x{m['old']:>12,.0f}{m['new']:>12,.0f}{m['new'] / m['old']:>9.2f}")
    print(f"(one thread, CPU time; load average up to {load:.1f} on {os.cpu_count()} cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["accuracy", "speed"])
    ap.add_argument("--problems", type=int, default=500)
    args = ap.parse_args()
    if args.only in (None, "accuracy"):
        bench_accuracy(args.problems)
    if args.only in (None, "speed"):
        bench_speed()


if __name__ == "__main__":
    main()
