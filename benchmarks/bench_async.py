"""Asynchronous GRPO with bounded staleness against the synchronous run, side by side (issue 25).

The arithmetic GRPO task (experiments/arith_grpo.py: 32 prompts x 8 answers per iteration, from the shipped
SFT checkpoint) on the local 2-device CPU cluster with a disaggregated plan: generation and the rule reward
on device 0, the reference and the train step on device 1. Each staleness eta runs the same number of
iterations with the same seed, one after the other in this one process, through ``realloc run``; eta > 0
uses the decoupled objective (``grpo.decoupled``). With ``--rounds R`` the etas run in turn R times (0, 1, 2,
0, 1, 2, ...), so that a change in the machine's load falls on all of them. The table gives the measured time
per iteration (mean over the iterations after the first ``--warmup``; the median over rounds), the
estimator's figure for the same plan (the simulator of the run-ahead pipeline, ``PlanSpace.with_staleness``),
both speed-ups over eta = 0, the share of the train steps' time during which generation ran beside them
(from the trace; it shows the pipeline even when a loaded machine blurs the times), and the greedy exact match on the 128 held-out prompts after the last iteration
(evaluated every 5 iterations; the same in every round, which runs the same seed).

    .venv/bin/python benchmarks/bench_async.py --iterations 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides
from realloc.search.build import PlanSpace

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = str(REPO / "experiments/arith_grpo.py")
SPLIT = {"actor_gen": ("localhost:0", 1, 1, 1, 1), "rew_inf": ("localhost:0", 1, 1, 1, 1),
         "ref_inf": ("localhost:1", 1, 1, 1, 1), "actor_train": ("localhost:1", 1, 1, 1, 1)}


def plan_of(eta: int, sets: list[str]) -> tuple[ExecutionPlan, float]:
    """The disaggregated plan at staleness eta, with the estimator's time per iteration for it."""
    graph = build_graph(load_with_overrides(EXPERIMENT, sets))
    plan = ExecutionPlan.by_hand(graph, SPLIT, staleness=eta, source="bench_async")
    space = PlanSpace.build(graph, keep=[plan]).with_staleness(eta)
    return plan, float(space.evaluate(space.indices_of(plan))["time"])


def overlap(trace: Path) -> float:
    """The share of the train steps' time (device 1) during which a generation ran (device 0), from the trace:
    about 0 when the two take turns (synchronous), up to 1 when generation runs entirely beside training. Unlike
    the time per iteration, the structure of the schedule shows through a loaded machine."""
    ev = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0]
    gen = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == "actor_gen" and e["tid"] == 0]
    train = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e["name"] == "actor_train" and e["tid"] == 1]
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in train for c, d in gen)
    return both / max(sum(b - a for a, b in train), 1e-9)


def run(eta: int, iterations: int, base: Path, tag: str = "") -> dict:
    sets = [f"max_staleness={eta}", f"iterations={iterations}"] + (["grpo.decoupled=true"] if eta else [])
    plan, estimate = plan_of(eta, sets)
    plan.save(base / f"plan{eta}.json")
    run_dir = base / f"eta{eta}{tag}"
    cmd = [sys.executable, "-m", "realloc.cli", "run", EXPERIMENT, "--plan", str(base / f"plan{eta}.json"),
           "--run-dir", str(run_dir), "--iterations", str(iterations), "--quiet",
           *[a for s in sets for a in ("--set", s)]]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(base)})
    if r.returncode:
        raise SystemExit(f"eta={eta}: realloc run failed:\n{r.stdout}\n{r.stderr}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m["eval"]["reward"] for m in metrics if "eval" in m]
    return {"metrics": metrics, "estimate": estimate, "eval": evals[-1] if evals else float("nan"),
            "overlap": overlap(run_dir / "trace.json"),
            "staleness": max((m.get("staleness", {}).get("max", 0) for m in metrics), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="iterations left out of the mean time")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    times: dict[int, list[float]] = {eta: [] for eta in args.etas}
    res: dict[int, dict] = {}
    overlaps: dict[int, list[float]] = {eta: [] for eta in args.etas}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for k in range(args.rounds):
            for eta in args.etas:
                res_k = run(eta, args.iterations, Path(tmp), f"_{k}")
                ms = res_k["metrics"][args.warmup:]
                times[eta].append(sum(m["iteration_time"] for m in ms) / len(ms))
                overlaps[eta].append(res_k["overlap"])
                res.setdefault(eta, res_k)
    meas = {eta: statistics.median(ts) for eta, ts in times.items()}
    b = args.etas[0]
    print(f"arith GRPO, {args.iterations} iterations, generation on device 0, training on device 1 "
          f"(mean s/iteration after {args.warmup}, median of {args.rounds} round(s) "
          f"{', '.join(f'{eta}: ' + '/'.join(f'{t:.3f}' for t in ts) for eta, ts in times.items())}); "
          f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'eta':>4}{'measured s/it':>15}{'speed-up':>10}{'estimated s/it':>16}{'est. speed-up':>15}"
          f"{'gen beside train':>18}{'max staleness':>15}{'held-out exact match':>22}")
    for eta, r in res.items():
        print(f"{eta:>4}{meas[eta]:>15.3f}{meas[b] / meas[eta]:>9.2f}x{r['estimate']:>16.3f}"
              f"{res[b]['estimate'] / r['estimate']:>14.2f}x{statistics.median(overlaps[eta]):>17.0%} "
              f"{r['staleness']:>14}{r['eval']:>22.3f}")


if __name__ == "__main__":
    main()
