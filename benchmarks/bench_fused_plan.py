"""Dry run of searched fusion at RLHFuse's 65B actor / 33B critic setting (rlhfuse.txt §7; experiments/ppo_65b_33b.py):
the plan the search finds with fused train pairs as a choice, the best plan it finds without them, and the
training stage of each beside the paper's 1.2-1.3x (Figure 8: intra-stage fusion against RLHFuse-Base).

    .venv/bin/python benchmarks/bench_fused_plan.py                 # 120 s of search, one thread
    .venv/bin/python benchmarks/bench_fused_plan.py --search-time 300
    .venv/bin/python benchmarks/bench_fused_plan.py --nodes 8       # the same models on 64 GPUs

"training" is the span of the two train calls in a steady-state iteration of the simulator's schedule (from the
first's start to the last's end). "fused/serial" prices the fused plan's pair both ways on its own placement
(estimator/fused_cost.py): the gain of fusing alone, which is what the paper's 1.2-1.3x measures. Estimates only:
no GPU runs here.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from realloc import _C
from realloc.api import load_experiment
from realloc.estimator.fused_cost import price_fused_pair
from realloc.graph.plan import ExecutionPlan
from realloc.search.planner import plan_search
from realloc.search.timeline import estimate_plan

PAPER_TRAIN_GAIN = (1.2, 1.3)
TRAIN = ("actor_train", "critic_train")


def training_span(report, plan: ExecutionPlan) -> float:
    """Seconds from the first train call's start to the last one's end in the middle iteration of the schedule."""
    space, idx = estimate_plan(report.graph, plan, report.space.cost)
    names = space.problem.call_names
    mid = space.problem.n_iterations // 2
    spans = [(r[4], r[5]) for r in space.cpp.schedule(np.asarray(idx, np.int32))
             if r[0] == _C.NODE_CALL and r[3] == mid and names[r[1]] in TRAIN]
    return max(e for _, e in spans) - min(s for s, _ in spans)


def describe(plan: ExecutionPlan) -> str:
    parts = []
    for c in TRAIN:
        p = plan.placements[c]
        parts.append(f"{c} {p.mesh} dp{p.dp}·tp{p.tp}·pp{p.pp} {p.n_mbs} mb")
    return "; ".join(parts) + (" (fused)" if plan.fused else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="experiments/ppo_65b_33b.py")
    ap.add_argument("--search-time", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=0, help="nodes of the cluster (default: the experiment's)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    spec = load_experiment(args.experiment)
    if args.nodes:
        spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, nodes=(),
                                                                     nodelist=f"trainer[01-{args.nodes:02d}]"))
    report = plan_search(spec, args.search_time, seed=args.seed, n_threads=1)
    plan, unfused, fused = report.plan, report.unfused, report.fused
    rows = [("searched", plan)]
    if fused is not None:  # the best fused plan lost to one without fusion
        rows.append(("fused", fused))
    elif unfused is not None:
        rows.append(("no fusion", unfused))
    print(f"{report.spec.name}: {report.spec.cluster.describe()}")
    print(f"{'plan':<10} {'s/iteration':>11} {'training s':>10}  train calls")
    print("-" * 100)
    spans = {}
    for name, p in rows:
        spans[name] = training_span(report, p)
        print(f"{name:<10} {p.estimated_time:>11.3f} {spans[name]:>10.3f}  {describe(p)}")
    print()
    best_fused = plan if plan.fused else fused
    if best_fused is not None:
        r = price_fused_pair(report.space.cost, best_fused, *TRAIN)
        print(f"the fused plan's pair on its placement: {r.serial_time:.3f} s one after the other, {r.time:.3f} s "
              f"fused: training {r.speedup:.2f}x (paper {PAPER_TRAIN_GAIN[0]}-{PAPER_TRAIN_GAIN[1]}x); schedule bound "
              f"{r.serial_time / r.bound_time:.2f}x")
        other, name = (unfused, "no fusion") if plan.fused else (plan, "searched")
        key = "searched" if plan.fused else "fused"
        print(f"the fused plan against the best without fusion: iteration "
              f"{other.estimated_time / best_fused.estimated_time:.3f}x, training stage "
              f"{spans[name] / spans[key]:.2f}x" + ("" if plan.fused else "; the search keeps the plan without fusion"))
    else:
        print("the search found no fused plan: fusing does not pay here by the estimator")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
