"""Each call's estimate against its measured time on each device kind of a local run on two pools
(docs/heterogeneous.md, issue 32).

    .venv/bin/python benchmarks/bench_pool_run.py [--iterations 8] [--warmup 2] [--clock cpu|wall]

experiments/ppo_tiny_two_kinds.py has two pools of one CPU device each: ``cpu`` (fp32) and ``cpu-bf16`` (bf16).
Two hand-written plans run with ``realloc run``, the second the mirror of the first (every call on the other
pool), so that each call runs once on each kind. Per call and kind the table shows the estimator's seconds
(``CostModel.call_cost`` on the call's pool: its kind's profile, profiles/cpu/ and profiles/cpu-bf16/) next
to the measured time of the iterations after ``--warmup`` (the fastest and the median), read from the workers'
logs. ``--clock cpu`` (the default) measures each request in its worker thread's CPU time: on a machine that
other processes load, wall time counts their share of the cores too; ``--clock wall`` reads the wall time.
The profiles must be made with the same clock (profiles/cpu-bf16/README.md).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from realloc.api import load_experiment  # noqa: E402
from realloc.estimator.cost import CostModel  # noqa: E402
from realloc.graph.dataflow import build_graph  # noqa: E402
from realloc.graph.plan import ExecutionPlan, validate_plan  # noqa: E402

EXPERIMENT = str(ROOT / "experiments/ppo_tiny_two_kinds.py")
SPLIT = {"actor_gen": "cpu0", "rew_inf": "cpu0", "ref_inf": "cpu1", "critic_inf": "cpu1", "actor_train": "cpu0",
         "critic_train": "cpu0"}
MIRROR = {c: "cpu1" if m == "cpu0" else "cpu0" for c, m in SPLIT.items()}
LINE = re.compile(r"iteration (\d+) call (\w+): ([\d.]+) s \(cpu ([\d.]+) s\)")
LIMIT = 0.20  # the bound on each call's relative error


def measured(run_dir: Path, warmup: int, clock: str) -> dict[str, tuple[float, float]]:
    """call -> (fastest, median) seconds on ``clock`` over the iterations after ``warmup``, from the workers'
    logs. Other processes only ever add time, even CPU time (their cache misses, context switches): the
    fastest iteration is the least disturbed one (timeit's reason for a minimum; estimator_accuracy.py)."""
    seen: dict[str, list[float]] = {}
    for log in sorted((run_dir / "logs").glob("worker*.log")):
        for m in LINE.finditer(log.read_text()):
            if int(m.group(1)) > warmup:
                seen.setdefault(m.group(2), []).append(float(m.group(4 if clock == "cpu" else 3)))
    return {c: (min(xs), statistics.median(xs)) for c, xs in seen.items()}


def run(placement: dict[str, str], name: str, iterations: int, base: Path) -> Path:
    graph = build_graph(load_experiment(EXPERIMENT))
    plan = base / f"{name}.json"
    ExecutionPlan.by_hand(graph, {c: (m, 1, 1, 1, 1) for c, m in placement.items()}, source=name).save(plan)
    out = base / name
    cmd = [sys.executable, "-m", "realloc.cli", "run", EXPERIMENT, "--plan", str(plan), "--iterations",
           str(iterations), "--run-dir", str(out), "--quiet", "--no-final-checkpoint"]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(base)},
                   stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    spec = load_experiment(EXPERIMENT)
    graph = build_graph(spec)
    cost = CostModel(graph)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, placement in (("split", SPLIT), ("mirror", MIRROR)):
            plan = ExecutionPlan.by_hand(graph, {c: (m, 1, 1, 1, 1) for c, m in placement.items()})
            meshes = validate_plan(plan, graph)
            got = measured(run(placement, name, args.iterations, Path(tmp)), args.warmup, args.clock)
            for c in graph.topo_order:
                p = plan.placements[c]
                est = cost.call_cost(c, meshes[c], p.strategy, p.n_mbs, p.recompute).time
                rows.append((c, spec.cluster.pools[meshes[c].pool].device, est, *got[c]))
    load = os.getloadavg()[0]
    print(f"\n{len(rows)} calls, measured in {args.clock} time over iterations {args.warmup + 1}..{args.iterations}; "
          f"load average {load:.1f} on {os.cpu_count()} cores\n")
    header = (f"{'call':<14}{'kind':<10}{'est. s':>9}{'fastest s':>11}{'est/fastest':>13}{'median s':>10}"
              f"{'est/median':>12}")
    print(header)
    print("-" * len(header))
    for c, kind, est, fast, median in sorted(rows, key=lambda r: (r[0], r[1])):
        mark = "" if abs(est / median - 1) <= LIMIT else "  (median outside +-20%)"
        print(f"{c:<14}{kind:<10}{est:>9.4f}{fast:>11.4f}{est / fast:>13.2f}{median:>10.4f}{est / median:>12.2f}{mark}")
    # the rule reward is a few hundred microseconds of Python per request, below what the logs resolve well
    model_calls = [r for r in rows if r[0] != "rew_inf"]
    for i, what in ((3, "fastest"), (4, "median")):
        inside = sum(abs(r[2] / r[i] - 1) <= LIMIT for r in model_calls)
        print(f"model calls within +-20% of the {what} iteration: {inside} of {len(model_calls)}")


if __name__ == "__main__":
    main()
