"""A fused actor/critic train step's passes, measured against the estimator's price of them (docs/fused-training.md,
"Where a fused step's time goes").

Reads runs kept by ``bench_fusion.py --keep DIR`` whose plan fuses a train pair: each worker's
``fused_passes/worker*.jsonl`` (every pass's start and end), the request's span (``requests.jsonl``), and prices the
same pair with the estimator (``CostModel.train_passes``, ``fused_cost.price_fused_pair``). Per run it prints, per
device and optimizer step (medians over the kept requests):

- ``pass``: a forward and a backward pass's mean seconds, measured (from its input's arrival to its end) and
  estimated (the mean over stages of ``train_passes``, per model);
- ``busy``: the sum of the step's passes; ``window``: first pass start to last pass end; the estimate's makespan;
- ``rest``: the request's span less its steps' windows (optimizer steps, the interface's host work), against the
  estimate's serial time less its pipeline parts.

    .venv/bin/python benchmarks/bench_fused_passes.py DIR [--profiles PROFILES]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measured(run: Path) -> dict[str, float]:
    """Medians over requests and devices: per-pass seconds by (model, backward), step busy and window, the rest."""
    spans = {}
    for line in (run / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "+" in r["label"]:
            spans[r["req"]] = r["spans"]
    acc: dict[str, list[float]] = defaultdict(list)
    for f in sorted((run / "fused_passes").glob("worker*.jsonl")):
        w = f.stem.removeprefix("worker")
        for line in f.read_text().splitlines():
            r = json.loads(line)
            span = spans[r["req"]][w]
            windows = 0.0
            for step in sorted({p[0] for p in r["passes"]}):
                q = [p for p in r["passes"] if p[0] == step]
                for m in (0, 1):
                    for bw in (0, 1):
                        acc[f"pass m{m} {'bwd' if bw else 'fwd'}"] += [p[5] - p[4] for p in q if p[1] == m and p[2] == bw]
                acc["busy"].append(sum(p[5] - p[4] for p in q))
                win = max(p[5] for p in q) - min(p[4] for p in q)
                acc["window"].append(win)
                windows += win
            acc["rest"].append(span[1] - span[0] - windows)
            acc["span"].append(span[1] - span[0])
    return {k: statistics.median(v) for k, v in acc.items()}


def estimated(graph, plan) -> dict[str, float]:
    from realloc.estimator.cost import CostModel
    from realloc.estimator.fused_cost import price_fused_pair

    cost = CostModel(graph)
    first, second = plan.fused[0]
    out: dict[str, float] = {}
    for m, call in enumerate((first, second)):
        p = plan.placements[call]
        fwd, bwd, _ = cost.train_passes(call, cost.cluster.mesh(p.mesh), p.strategy, p.n_mbs, p.recompute)
        out[f"pass m{m} fwd"], out[f"pass m{m} bwd"] = statistics.mean(fwd), statistics.mean(bwd)
    price = price_fused_pair(cost, plan, first, second)
    out["window"] = price.schedule.makespan
    out["busy"] = sum(out[f"pass m{m} {d}"] * plan.placements[c].n_mbs
                      for m, c in enumerate((first, second)) for d in ("fwd", "bwd"))
    out["span"] = price.time
    out["rest"] = price.time - price.n_steps * price.schedule.makespan
    return out


def main() -> int:
    from bench_call_estimates import kept_runs

    from realloc.graph.plan import ExecutionPlan

    base, graph = kept_runs(__doc__)
    for run in sorted(d for d in base.iterdir() if (d / "fused_passes").is_dir() and (d / "plan.json").exists()):
        plan = ExecutionPlan.load(run / "plan.json")
        if not plan.fused:
            continue
        meas, est = measured(run), estimated(graph, plan)
        n = {c: plan.placements[c].n_mbs for c in plan.fused[0]}
        print(f"{run.name}: {' + '.join(plan.fused[0])}, pp {plan.placements[plan.fused[0][0]].strategy.pp}, "
              f"n_mbs {n}")
        print(f"  {'':<14}{'measured ms':>12}{'est ms':>10}{'est/meas':>10}")
        for k in sorted(est):
            print(f"  {k:<14}{meas[k] * 1e3:12.2f}{est[k] * 1e3:10.2f}{est[k] / meas[k]:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
