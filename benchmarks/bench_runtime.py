"""Runtime benchmark on the local CPU cluster: the demo's per-iteration overhead, and iteration time per plan.

    .venv/bin/python benchmarks/bench_runtime.py [--iterations 10] [--warmup 2] [--search-time 10]
    .venv/bin/python benchmarks/bench_runtime.py --demo-only [--demo-iterations 20]

First the demo's GRPO stage (``experiments/arith_grpo.py``, what ``make demo`` trains), one line per iteration:
its time, the workers' compute in it, and the rest, the overhead (``realloc/runtime/records/overhead.py``): in-run
evaluation outside compute, reallocations and data transfers, and the master's share (scheduling, messaging,
replies on their way, gaps between calls); then the run's start-up breakdown (``startup.json``).

For the tiny PPO experiment (2 gloo devices) it runs the heuristic plan, the searched plan and a
few hand-written ones with ``realloc run`` and prints, from one invocation:

- steady-state seconds per iteration, tokens/s and the ratio to the heuristic plan;
- how the devices spent their time: calls, parameter reallocation (paper: 2.2% of GPU time,
  realhf.txt §8.2), data transfer, idle;
- the master's overhead per dispatched request: the latency a request sees beyond its work and
  beyond waiting for the requests queued before it on the same worker (median and mean).

Machine load from other processes shows up directly in these numbers: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from realloc.api import load_experiment  # noqa: E402
from realloc.graph.dataflow import build_graph  # noqa: E402
from realloc.graph.plan import ExecutionPlan  # noqa: E402
from realloc.runtime.records.overhead import iteration_overheads  # noqa: E402
from realloc.runtime.records.telemetry import RequestRecord, dispatch_overheads  # noqa: E402

EXPERIMENT = str(REPO / "experiments/ppo_tiny.py")
DEMO = str(REPO / "experiments/arith_grpo.py")
CALLS = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")
HAND = {
    "one device": {c: ("localhost:0", 1, 1, 1, 1) for c in CALLS},
    "dp2 everywhere": {c: ("localhost", 2, 1, 1, 1) for c in CALLS},
    "actor | critic": {"actor_gen": ("localhost:0", 1, 1, 1, 1), "rew_inf": ("localhost:0", 1, 1, 1, 1),
                       "ref_inf": ("localhost:1", 1, 1, 1, 1), "critic_inf": ("localhost:1", 1, 1, 1, 1),
                       "actor_train": ("localhost:0", 1, 1, 1, 1), "critic_train": ("localhost:1", 1, 1, 1, 1)},
    "tp/pp + realloc": {"actor_gen": ("localhost", 2, 1, 1, 1), "rew_inf": ("localhost:1", 1, 1, 1, 1),
                        "ref_inf": ("localhost:1", 1, 1, 1, 2), "critic_inf": ("localhost", 1, 1, 2, 2),
                        "actor_train": ("localhost", 1, 2, 1, 2), "critic_train": ("localhost", 1, 1, 2, 2)},
}


def hand_plan(name: str) -> ExecutionPlan:
    spec = load_experiment(EXPERIMENT)
    g = build_graph(spec)
    return ExecutionPlan.by_hand(g, HAND[name], source=name)


def run(name: str, plan_args: list[str], iterations: int, base: Path) -> dict:
    run_dir = base / name.replace(" ", "_").replace("/", "_").replace("|", "_")
    cmd = [sys.executable, "-m", "realloc.cli", "run", EXPERIMENT, *plan_args, "--iterations", str(iterations),
           "--run-dir", str(run_dir), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(base)})
    if r.returncode != 0:
        return {"name": name, "error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = []
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        d = json.loads(line)
        records.append(RequestRecord(req=d["req"], kind=d["kind"], label=d["label"], iteration=d["iteration"],
                                     node="", dispatched=d["dispatched"], completed=d["completed"],
                                     spans={int(k): tuple(v) for k, v in d["spans"].items()},
                                     received={int(k): v for k, v in d["received"].items()}))
    return {"name": name, "metrics": metrics, "records": records,
            "plan": json.loads((run_dir / "plan.json").read_text())}


def steady(res: dict, warmup: int) -> dict:
    ms = res["metrics"][warmup:]
    first, last = ms[0]["iteration"], ms[-1]["iteration"]
    # The steady window: from the end of the last warm-up iteration to the end of the run.
    recs = [r for r in res["records"] if first <= r.iteration <= last and r.kind in ("call", "realloc", "data",
                                                                                      "offload")]
    begin = min(s for r in recs for s, _ in r.spans.values())
    end = max(e for r in recs for _, e in r.spans.values())
    n_dev = 2
    busy: dict[str, float] = {}
    for r in recs:
        busy[r.kind] = busy.get(r.kind, 0.0) + sum(e - s for s, e in r.spans.values())
    span = (end - begin) * n_dev
    ov = dispatch_overheads([r for r in res["records"] if first <= r.iteration <= last])
    n_calls = sum(1 for r in recs if r.kind == "call")
    return {"s_per_it": statistics.median(m["iteration_time"] for m in ms),
            "tok_s": sum(m["tokens"] for m in ms) / sum(m["iteration_time"] for m in ms),
            "call": busy.get("call", 0) / span, "realloc": busy.get("realloc", 0) / span,
            "data": busy.get("data", 0) / span,
            "idle": max(0.0, 1 - sum(busy.values()) / span),
            "ov_median_ms": statistics.median(ov) * 1e3, "ov_mean_ms": statistics.fmean(ov) * 1e3,
            "requests_per_it": len(recs) / len(ms), "calls_per_it": n_calls / len(ms),
            "reward": res["metrics"][-1].get("reward", float("nan")),
            "estimated": res["plan"].get("estimated_time")}


def demo_overhead(iterations: int, base: Path) -> None:
    """The demo's GRPO stage: per iteration its time, the workers' compute and the overhead's parts."""
    run_dir = base / "demo"
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", DEMO, "--iterations", str(iterations),
                        "--run-dir", str(run_dir), "--quiet"], capture_output=True, text=True,
                       env={**os.environ, "TMPDIR": str(base)})
    if r.returncode != 0:
        print(f"demo run failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return
    records = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    evals = {rec["iteration"] for rec in records if rec["kind"] == "eval"}
    rows = iteration_overheads(records)
    print(f"demo GRPO stage ({DEMO.split('/')[-1]}: 32 prompts x 8 samples, 4 new tokens) on 2 CPU devices, "
          f"{iterations} iterations; seconds")
    header = f"{'iter':>4}{'time':>8}{'compute':>9}{'overhead':>10}{'share':>7}{'eval':>7}{'moves':>7}{'master':>8}"
    print(header)
    print("-" * len(header))
    for o in rows:
        mark = "  (evaluates)" if o.iteration in evals else ""
        print(f"{o.iteration:>4}{o.window:>8.3f}{o.compute:>9.3f}{o.overhead:>10.3f}{o.overhead / o.window:>7.1%}"
              f"{o.eval:>7.3f}{o.moves:>7.3f}{o.master:>8.3f}{mark}")
    # steady state: after the first iteration, the evaluating ones and the one their passes overlap left out
    steady = [o for o in rows[1:] if o.iteration not in evals and o.iteration - 1 not in evals]
    if steady:
        ov = statistics.median(o.overhead / o.window for o in steady)
        master = statistics.median(o.master for o in steady)
        print(f"median over {len(steady)} iterations without evaluation (and not the first): "
              f"{statistics.median(o.window for o in steady):.3f} s/iteration, overhead {ov:.1%} of it, the "
              f"master's share {master * 1e3:.1f} ms")
    startup = run_dir / "startup.json"
    line = next((x for x in r.stdout.splitlines() if x.startswith("start-up")), None)
    if line:
        print(line)
    elif startup.is_file():
        print(f"start-up: {startup.read_text()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo-iterations", type=int, default=20, help="iterations of the demo's overhead table")
    p.add_argument("--demo-only", action="store_true", help="only the demo's per-iteration overhead")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--search-time", type=float, default=10.0)
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed at the end)")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_runtime_"))
    try:
        demo_overhead(args.demo_iterations, base)
        if not args.demo_only:
            print()
            report(args, base)
    finally:
        if args.keep:
            print(f"\nrun directories: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def report(args: argparse.Namespace, base: Path) -> None:
    jobs = [("heuristic", ["--baseline", "heuristic"]), ("searched", ["--search-time", str(args.search_time)])]
    for name in HAND:
        path = base / f"{name.replace(' ', '_').replace('/', '_').replace('|', '_')}.json"
        hand_plan(name).save(path)
        jobs.append((name, ["--plan", str(path)]))
    results = []
    for name, plan_args in jobs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results.append(run(name, plan_args, args.iterations, base))

    ok = {r["name"]: steady(r, args.warmup) for r in results if "error" not in r}
    ref = ok.get("heuristic", {}).get("s_per_it")
    print(f"\ntiny PPO (batch 32, 8+8 tokens) on 2 CPU devices, {args.iterations} iterations, "
          f"median of iterations {args.warmup + 1}..{args.iterations}")
    header = (f"{'plan':<18}{'est.':>7}{'s/iter':>8}{'tok/s':>8}{'vs heur.':>9}{'calls':>7}{'realloc':>8}{'data':>7}"
              f"{'idle':>7}{'ovh med':>9}{'ovh mean':>9}{'req/it':>7}{'reward':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['name']:<18} failed: {r['error']}")
            continue
        s = ok[r["name"]]
        ratio = f"{ref / s['s_per_it']:.2f}x" if ref else "-"
        est = f"{s['estimated']:.3f}" if s["estimated"] else "-"
        print(f"{r['name']:<18}{est:>7}{s['s_per_it']:>8.3f}{s['tok_s']:>8.0f}{ratio:>9}{s['call']:>7.1%}{s['realloc']:>8.1%}"
              f"{s['data']:>7.1%}{s['idle']:>7.1%}{s['ov_median_ms']:>8.2f}m{s['ov_mean_ms']:>8.2f}m"
              f"{s['requests_per_it']:>7.0f}{s['reward']:>8.3f}")
    print("\nest.: the plan's estimated s/iteration (search and baselines only); calls/realloc/data/idle: share of all devices' time; ovh: master overhead per request (ms), beyond "
          "the work and the queue ahead of it on its worker.")
    for r in results:
        if "plan" in r and r["name"] in ("heuristic", "searched"):
            pl = r["plan"]["placements"]
            print(f"{r['name']} plan: " + ", ".join(f"{c} {pl[c]['mesh']} dp{pl[c]['dp']}tp{pl[c]['tp']}pp{pl[c]['pp']}"
                                                   f"/{pl[c]['n_mbs']}" for c in CALLS))


if __name__ == "__main__":
    main()
