"""Soak: a long ppo_tiny run, with the resident memory of the master and of each worker along the way.

    .venv/bin/python benchmarks/bench_soak.py [--iterations 1000] [--every 100]

The master must not keep per-iteration state (issue 15: it grew ~55 KiB per iteration, 249 -> 304 MiB
over 1,000 iterations, holding every request record, trace event and scheduling event until exit).
The table gives RSS after the first iteration, then every ``--every`` iterations up to the last; the
growth rate is fitted from the end of the warm-up (``--warmup``) to the last sample.

Machine load changes timings, not memory; the load is printed anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from realloc.api import load_experiment  # noqa: E402
from realloc.graph.dataflow import build_graph  # noqa: E402
from realloc.graph.plan import CallPlacement, ExecutionPlan  # noqa: E402

EXPERIMENT = str(REPO / "experiments/ppo_tiny.py")
# Inference on disjoint devices, actor training across both: the actor is reallocated and the data crosses
# devices every iteration, so the master plans and dispatches many requests per iteration.
DISJOINT = {"actor_gen": ("localhost:0", 1, 1, 1, 1), "rew_inf": ("localhost:0", 1, 1, 1, 1),
            "ref_inf": ("localhost:1", 1, 1, 1, 1), "critic_inf": ("localhost:1", 1, 1, 1, 1),
            "actor_train": ("localhost", 2, 1, 1, 1), "critic_train": ("localhost:1", 1, 1, 1, 2)}


def write_plan(path: Path) -> None:
    spec = load_experiment(EXPERIMENT)
    g = build_graph(spec)
    ExecutionPlan(experiment=spec.name, graph_digest=g.digest, nodelist=spec.cluster.nodelist,
                  n_devices_per_node=spec.cluster.n_devices_per_node, device=spec.cluster.device,
                  placements={c: CallPlacement(mesh=m, dp=d, tp=t, pp=p, n_mbs=n)
                              for c, (m, d, t, p, n) in DISJOINT.items()}, source="disjoint").save(path)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def n_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except FileNotFoundError:
        return 0


def soak(args: argparse.Namespace, base: Path) -> None:
    plan, run_dir = base / "plan.json", base / "run"
    write_plan(plan)
    cmd = [sys.executable, "-m", "realloc.cli", "run", EXPERIMENT, "--plan", str(plan), "--iterations",
           str(args.iterations), "--run-dir", str(run_dir), "--quiet", *args.extra]
    marks = sorted({1, args.warmup, *range(args.every, args.iterations, args.every), args.iterations - 1})
    samples: list[tuple[int, float, list[float]]] = []
    t0 = time.monotonic()
    with open(base / "stdout.log", "w") as out, open(base / "stderr.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "TMPDIR": str(base)})
    try:
        workers: list[int] = []
        for mark in marks:
            while n_lines(run_dir / "metrics.jsonl") < mark:
                if proc.poll() is not None:
                    raise RuntimeError(f"the run ended early: {(base / 'stderr.log').read_text()[-2000:]}")
                time.sleep(0.02)
            if not workers:
                info = json.loads((run_dir / "workers.json").read_text())
                workers = [w["pid"] for _, w in sorted(info["workers"].items(), key=lambda kv: int(kv[0]))]
            samples.append((mark, rss_mib(proc.pid), [rss_mib(p) for p in workers]))
            print(f"  iteration {mark}: master {samples[-1][1]:.1f} MiB", file=sys.stderr, flush=True)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        raise RuntimeError(f"realloc run exited {code}: {(base / 'stderr.log').read_text()[-2000:]}")
    seconds = time.monotonic() - t0
    report(args, samples, seconds)


def slope_kib_per_iteration(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of MiB over iterations, in KiB per iteration."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 1024 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def report(args: argparse.Namespace, samples: list[tuple[int, float, list[float]]], seconds: float) -> None:
    n_workers = len(samples[0][2])
    print(f"\nsoak: ppo_tiny, disjoint plan, {args.iterations} iterations in {seconds:.0f} s "
          f"(load average {os.getloadavg()[0]:.1f})")
    header = f"{'iteration':>10}{'master MiB':>12}" + "".join(f"{f'worker{r} MiB':>13}" for r in range(n_workers))
    print(header)
    print("-" * len(header))
    for it, master, workers in samples:
        print(f"{it:>10}{master:>12.1f}" + "".join(f"{w:>13.1f}" for w in workers))
    steady = [s for s in samples if s[0] >= args.warmup]
    first, last = steady[0], steady[-1]
    rates = [slope_kib_per_iteration([(it, m) for it, m, _ in steady])]
    rates += [slope_kib_per_iteration([(it, w[r]) for it, _, w in steady]) for r in range(n_workers)]
    print(f"{'KiB/iter':>10}{rates[0]:>+12.2f}" + "".join(f"{r:>+13.2f}" for r in rates[1:]))
    print(f"\nfrom iteration {first[0]} to {last[0]}: master {first[1]:.1f} -> {last[1]:.1f} MiB ({last[1] - first[1]:+.1f}), "
          + ", ".join(f"worker{r} {first[2][r]:.1f} -> {last[2][r]:.1f} MiB ({last[2][r] - first[2][r]:+.1f})"
                      for r in range(n_workers)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="sample memory every N iterations")
    p.add_argument("--warmup", type=int, default=20, help="iterations before the growth fit starts")
    p.add_argument("--keep", action="store_true", help="keep the run directory (printed at the end)")
    p.add_argument("extra", nargs="*", help="more `realloc run` arguments, after --")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_soak_"))
    try:
        soak(args, base)
    finally:
        if args.keep:
            print(f"\nrun directory: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
