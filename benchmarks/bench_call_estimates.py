"""Each call's estimate against its measured wall and CPU time, plan by plan, from the runs a benchmark kept
(``bench_fusion.py --setting fit --keep DIR``, ``bench_chunked.py --keep DIR``; docs/estimator.md, "Where a
generation's time goes").

For every run directory under DIR (one plan, one round) and every call: the worker's wall seconds and CPU seconds
(``logs/worker*.log``: each request's "X s (cpu Y s)"; a call in several requests, a streamed generation's parts,
summed; the slowest device; the median over iterations 2..), beside the simulator's seconds for the call in a
middle iteration of the plan's schedule (the sum of its parts), priced with the profiles in use
(``--profiles DIR``, as the runs had them). CPU time is what the layers and the host did; wall minus CPU is the
time the process waited: for a peer's collective, or, on a loaded machine, for a core. A ratio est/cpu near 1 with
est/wall low says the estimate prices the work and the machine's load stretched it.

    .venv/bin/python benchmarks/bench_call_estimates.py DIR [--profiles PROFILES]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LINE = re.compile(r"iteration (\d+) call ([\w.+-]+)[^:]*: ([0-9.]+) s \(cpu ([0-9.]+) s\)")


def measured(run_dir: Path) -> dict[str, tuple[float, float]]:
    """Per call: the medians over iterations 2.. of its wall and CPU seconds on its slowest device."""
    per: dict[str, dict[tuple[int, str], list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for log in sorted((run_dir / "logs").glob("worker*.log")):
        for line in log.read_text().splitlines():
            m = LINE.search(line)
            if m and int(m.group(1)) >= 2:
                acc = per[m.group(2)][int(m.group(1)), log.name]
                acc[0] += float(m.group(3))
                acc[1] += float(m.group(4))
    out = {}
    for label, parts in per.items():
        its: dict[int, list[list[float]]] = defaultdict(list)
        for (it, _), v in parts.items():
            its[it].append(v)
        out[label] = (statistics.median(max(v[0] for v in vs) for vs in its.values()),
                      statistics.median(max(v[1] for v in vs) for vs in its.values()))
    return out


def estimated(graph, plan) -> dict[str, float]:
    """Per call: its seconds in a middle iteration of the simulator's schedule (parts summed)."""
    from realloc.estimator.cost import CostModel
    from realloc.search.timeline import estimate_plan

    space, idx = estimate_plan(graph, plan, CostModel(graph))
    names = space.problem.call_names
    mid = space.problem.n_iterations // 2
    out: dict[str, float] = defaultdict(float)
    for r in space.cpp.schedule(idx):  # kinds 0 call, 3 a tail's second part, 5 a consumer's part 1
        if r[3] == mid and r[0] in (0, 3, 5) and r[5] > r[4]:
            out[names[r[1]]] += r[5] - r[4]
    return dict(out)


def kept_runs(doc: str):
    """The command line's kept-runs folder and its experiment's graph, priced with ``--profiles`` if given."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", help="the folder a benchmark kept its runs in (--keep)")
    p.add_argument("--profiles", default=None, help="profiles folder ($REALLOC_PROFILES) the runs were priced with")
    args = p.parse_args()
    if args.profiles:
        os.environ["REALLOC_PROFILES"] = str(Path(args.profiles).resolve())
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph

    base = Path(args.runs)
    exp = next(base.glob("*.py"), None)
    if exp is None:
        raise SystemExit(f"{base}: no experiment file (a benchmark's --keep folder holds one)")
    return base, build_graph(load_experiment(str(exp)))


def main() -> int:
    from realloc.graph.plan import ExecutionPlan

    base, graph = kept_runs(__doc__)
    print(f"{'run':<30}{'call':<14}{'wall':>8}{'cpu':>8}{'est':>8}{'est/cpu':>8}{'est/wall':>9}")
    for run in sorted(d for d in base.iterdir() if (d / "logs").is_dir() and (d / "plan.json").exists()):
        est = estimated(graph, ExecutionPlan.load(run / "plan.json"))
        for label, (wall, cpu) in sorted(measured(run).items()):
            # a fused actor/critic train step ("actor_train+critic_train") runs its parts side by side
            e = max((est.get(part, float("nan")) for part in label.split("+")), default=float("nan"))
            print(f"{run.name:<30}{label:<14}{wall:8.4f}{cpu:8.4f}{e:8.4f}{e / cpu:8.2f}{e / wall:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
