"""Does the search miss a better split of the calls between two pools? Every assignment of the calls to the pools,
each searched alone (docs/heterogeneous.md, "FlexRLHF Table III, revisited"; issue 32).

    .venv/bin/python benchmarks/bench_pool_assignments.py                     # FlexRLHF Table III, ~3 min
    .venv/bin/python benchmarks/bench_pool_assignments.py --per-assignment 5 --experiment experiments/grpo_h100_h20.py

First ``realloc search``'s own search (``--search-time``), then, for each of the 2^n ways to put the n calls on the
two pools, an MCMC restricted to the candidates of that assignment (from the same space: the same prices and the
same pruning), ``--per-assignment`` seconds each. The table lists the best assignments by their estimate beside
the search's plan: an assignment faster than the search's plan would be a search gap. Estimates only, no GPU.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from realloc.api import load_experiment  # noqa: E402
from realloc.search.engine import run_mcmc  # noqa: E402
from realloc.search.planner import plan_search  # noqa: E402
from realloc.search.pool_space import on_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="experiments/ppo_33b_a100_v100.py")
    ap.add_argument("--search-time", type=float, default=30.0, help="seconds of the full search")
    ap.add_argument("--per-assignment", type=float, default=2.0, help="seconds of search per assignment")
    ap.add_argument("--top", type=int, default=8, help="assignments shown")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    spec = load_experiment(str(ROOT / args.experiment))
    if len(spec.cluster.pools) != 2:
        raise SystemExit(f"{args.experiment}: a cluster of two pools, please")
    t0 = time.perf_counter()
    report = plan_search(spec, args.search_time, seed=args.seed)
    space = report.space
    names = space.problem.call_names
    found = tuple(space.options[c][int(report.indices[c])].mesh.pool for c in range(len(names)))
    # Each assignment's chains start from the search's plan and the strongest pool's plan, each call kept where
    # the assignment allows it and otherwise at its fastest candidate on its assigned pool.
    plans = [report.indices, space.indices_of(on_cluster(report.alone.plan, report.graph))]
    rows = []
    for assign in itertools.product((0, 1), repeat=len(names)):
        keep = [[i for i, o in enumerate(space.options[c]) if o.mesh.pool == assign[c]] for c in range(len(names))]
        if not all(keep):
            continue  # a call with no candidate on that pool (it fits nowhere there, or is never faster)
        times = [space.problem.candidates[c].time for c in range(len(names))]
        sub = space.restrict(keep)
        starts = [np.array([keep[c].index(int(p[c])) if int(p[c]) in keep[c]
                            else int(np.argmin(times[c][keep[c]])) for c in range(len(names))]
                           + [0] * len(sub.problem.fused), np.int32)  # fused pairs off at the start
                  for p in plans]
        outcome = run_mcmc(sub, time_limit=args.per_assignment, seed=args.seed, n_threads=2, n_chains=2,
                           starts=starts)
        ev = outcome.evaluation
        rows.append((ev["time"] if ev["feasible"] else float("inf"), assign))
    rows.sort()
    alone = report.alone.plan.estimated_time
    pools = [p.device for p in spec.cluster.pools]
    print(f"{args.experiment}: {len(rows)} assignments with candidates, {args.per_assignment:g} s each; "
          f"{time.perf_counter() - t0:.0f} s in all")
    print(f"search ({args.search_time:g} s): {report.plan.estimated_time:.3f} s/iter, "
          f"{alone / report.plan.estimated_time:.3f}x the strongest pool alone ({alone:.3f} s/iter)\n")
    print("| s/iter | vs the pool alone | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for t, assign in rows[:args.top]:
        mark = " (the search's)" if assign == found else ""
        print(f"| {t:.3f}{mark} | {alone / t:.3f}x | " + " | ".join(pools[p] for p in assign) + " |")


if __name__ == "__main__":
    main()
