"""Estimated against measured time, plan by plan, on the local CPU cluster (realhf.txt §8.3, Figure 11).

    .venv/bin/python benchmarks/estimator_accuracy.py [--experiment experiments/ppo_small.py]
        [--iterations 10] [--warmup 3] [--repeats 3] [--search-time 10] [--no-profile] [--out benchmarks/out]

For one PPO experiment on the local 2-device cluster it builds at least 8 plans (the searched plan,
the heuristic and the other baselines, everything on one device, disjoint meshes with and without
reallocation, pp=2, tp=2, dp=2, pipelined generation with reallocation, pp=2 training with activation
recomputation), runs each with ``realloc run`` (``--repeats`` times, interleaved,
so that slow phases of the machine hit every plan alike), and prints from that one invocation:

- per plan, estimated against measured steady-state seconds per iteration (after ``--warmup``
  iterations, the median over iterations) and the relative error. "Measured" is the fastest of
  the repeats: this host is a VM whose other tenants slow it by 10-30% for seconds at a time and
  only ever add time (timeit's reason for reporting a minimum); the median repeat and its error are
  printed next to it;
- per call, estimated against measured worker time (a call's longest span on any of its devices),
  and the same for parameter reallocation and data transfer per iteration;
- the median and maximum error over plans, and the searched plan's speedup over the heuristic,
  estimated and measured;
- a picture (``--out``): estimated against measured per plan, and the estimated and measured
  timelines of one plan side by side.

It first profiles this machine with the commands of profiles/cpu/README.md for the experiment's
models (about 6 minutes for ``small``; the estimator reads profiles/cpu/*.json, which this rewrites).
``--no-profile`` uses the tables already there. The load average is printed next to
every run: other processes on the two cores show up directly in the measured times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from realloc import _C  # noqa: E402
from realloc.api import ExperimentSpec, load_experiment  # noqa: E402
from realloc.estimator.cost import CostModel  # noqa: E402
from realloc.graph.dataflow import DataflowGraph, build_graph  # noqa: E402
from realloc.graph.plan import ExecutionPlan, validate_plan  # noqa: E402
from realloc.search.build import PlanSpace  # noqa: E402
from realloc.search.planner import baseline, plan_search  # noqa: E402
from realloc.search.timeline import (draw_panel, estimate_plan, estimated_panel, legend_handles,  # noqa: E402
                                     measured_panel)

DEFAULT_EXPERIMENT = "experiments/ppo_small.py"
PROFILE_README = REPO / "profiles" / "cpu" / "README.md"


# -- plans -----------------------------------------------------------------------------------------------------

def _plan(spec: ExperimentSpec, graph: DataflowGraph, name: str, placements: dict[str, tuple[str, int, int, int, int]],
          recompute: frozenset[str] = frozenset()) -> ExecutionPlan:
    return ExecutionPlan.by_hand(graph, placements, recompute=recompute, source=name)


def hand_plans(spec: ExperimentSpec, graph: DataflowGraph) -> dict[str, ExecutionPlan]:
    """Hand-written plans of a PPO experiment on one node of 2 devices (calls named as in ppo_rpcs)."""
    node = spec.cluster.nodes[0]
    both, d0, d1 = node, f"{node}:0", f"{node}:1"
    calls = graph.topo_order
    rule = {c for c in calls if graph.model_config(c) is None}

    def uniform(mesh: str, dp: int, tp: int, pp: int, n_mbs: int) -> dict:
        size = dp * tp * pp
        return {c: ((mesh, size, 1, 1, 1) if c in rule else (mesh, dp, tp, pp, n_mbs)) for c in calls}

    one = {c: (d0, 1, 1, 1, 1) for c in calls}
    # actor and reference on device 0, critic and reward on device 1: disjoint meshes, no reallocation
    side = {"actor": d0, "ref": d0, "critic": d1, "reward": d1}
    split = {c: (side.get(graph.call(c).model_name, d1), 1, 1, 1, 1) for c in calls}
    # the same, but the actor generates data-parallel on both devices: reallocation before and after
    gen_dp2 = dict(split, actor_gen=(both, 2, 1, 1, 1))
    # training in a 2-stage pipeline, generation and inference split: reallocation between pp and dp layouts
    mixed = dict(split, actor_gen=(both, 2, 1, 1, 1), actor_train=(both, 1, 1, 2, 4), critic_train=(both, 1, 1, 2, 4))
    # the actor generates in a 2-stage pipeline of 4 micro-batches (pipelined decoding), reallocated there and back
    gen_pp2 = dict(split, actor_gen=(both, 1, 1, 2, 4))
    trains = frozenset(c for c in calls if graph.call(c).is_train and c not in rule)
    return {
        "one device": _plan(spec, graph, "one device", one),
        "actor | critic": _plan(spec, graph, "actor | critic", split),
        "gen dp2 + realloc": _plan(spec, graph, "gen dp2 + realloc", gen_dp2),
        "train pp2 + realloc": _plan(spec, graph, "train pp2 + realloc", mixed),
        "dp=2": _plan(spec, graph, "dp=2", uniform(both, 2, 1, 1, 1)),
        "pp=2": _plan(spec, graph, "pp=2", uniform(both, 1, 1, 2, 2)),
        "tp=2": _plan(spec, graph, "tp=2", uniform(both, 1, 2, 1, 1)),
        "gen pp2 pipelined + realloc": _plan(spec, graph, "gen pp2 pipelined + realloc", gen_pp2),
        "pp=2 + recompute": _plan(spec, graph, "pp=2 + recompute", uniform(both, 1, 1, 2, 2), trains),
    }


# -- estimates -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Estimate:
    plan: ExecutionPlan
    space: PlanSpace
    indices: np.ndarray
    time: float  # seconds per steady-state iteration
    calls: dict[str, float]  # seconds per call (the call's own work, as a worker runs it)
    realloc: float  # seconds of reallocation per steady-state iteration (sum of nodes)
    data: float  # seconds of data transfer per steady-state iteration (sum of nodes)


def estimate(graph: DataflowGraph, cost: CostModel, plan: ExecutionPlan) -> Estimate:
    """The estimator's and simulator's numbers for ``plan`` (the space restricted to its placements)."""
    space, idx = estimate_plan(graph, plan, cost)
    ev = space.evaluate(idx)
    meshes = validate_plan(plan, graph)
    want = {c: (meshes[c], p.strategy, p.n_mbs, p.recompute) for c, p in plan.placements.items()}
    p = space.problem
    records = space.cpp.schedule(idx)
    steady = range(p.priced_window[0] + 1, p.priced_window[1] + 1)  # the priced window's iterations
    realloc = sum(r[5] - r[4] for r in records if r[0] == _C.NODE_REALLOC and r[3] in steady) / len(steady)
    data = sum(r[5] - r[4] for r in records if r[0] == _C.NODE_DATA and r[3] in steady) / len(steady)
    calls = {c: cost.call_cost(c, *want[c]).time for c in graph.topo_order}
    return Estimate(plan, space, idx, float(ev["time"]), calls, realloc, data)


# -- the machine -----------------------------------------------------------------------------------------------

PROBE = ("import time, numpy as np\n"
         "a = np.random.default_rng(0).standard_normal((256, 256))\n"
         "for _ in range(20): a @ a\n"
         "t0 = time.perf_counter()\n"
         "for _ in range({n}): a @ a\n"
         "print(time.perf_counter() - t0)\n")


def probe_machine(n: int = 300) -> tuple[float, float]:
    """(seconds of a fixed single-threaded matmul loop alone, the same on two processes at once).

    This host is a VM: when its neighbours are busy, two processes on its two cores slow each other
    down by up to 30-50%, which no profile can foresee; the probe records the state next to each run.
    """
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = []
    for k in (1, 2):
        procs = [subprocess.Popen([sys.executable, "-c", PROBE.format(n=n)], stdout=subprocess.PIPE, text=True,
                                  env=env) for _ in range(k)]
        out.append(max(float(pr.communicate()[0]) for pr in procs))
    return out[0], out[1]


# -- runs ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    name: str
    run_dir: Path
    iteration_times: list[float]
    calls: dict[str, list[float]]  # per call: its time per steady iteration (see ``request_time``)
    realloc: list[float]  # per steady iteration: sum of reallocation request times
    data: list[float]  # per steady iteration: sum of data-transfer request times
    latency: list[float]  # dispatch latency: a call's start after its last predecessor's end, its devices idle
    load: tuple[float, float]  # 1-minute load average before and after
    seconds: float
    probe: tuple[float, float] = (0.0, 0.0)  # probe_machine() just before the run

    @property
    def time(self) -> float:
        return statistics.median(self.iteration_times)


def request_time(spans: dict) -> float:
    """From the moment every participant had started to the last one's end: the request's own time,
    without a participant's wait for one still busy with earlier work (the simulator's node duration)."""
    return max(e for _, e in spans.values()) - max(s for s, _ in spans.values())


def dispatch_latencies(graph: DataflowGraph, requests: list[dict], iterations: set[int]) -> list[float]:
    """The master's round trip: the start of a call (or data transfer) minus the end of the last call it
    waited for (its graph predecessors; a transfer's producer), where its devices were idle in between."""
    calls = {(r["label"], r["iteration"]): r for r in requests if r["kind"] == "call" and r["spans"]}
    producer = {k: c.name for c in graph.calls for k in c.output_data}
    busy: dict[int, list[tuple[float, float]]] = {}
    for r in requests:
        for dev, (s, e) in r["spans"].items():
            busy.setdefault(int(dev), []).append((s, e))
    out = []
    for r in requests:
        t = r["iteration"]
        if t not in iterations or not r["spans"]:
            continue
        if r["kind"] == "call" and r["label"] not in graph.graph:
            continue  # a fused pair's one request ("a+b")
        if r["kind"] == "call":
            waits = [calls.get((u, t)) for u in graph.graph.predecessors(r["label"])]
        elif r["kind"] == "data":
            waits = [calls.get((producer.get(r["label"].split(" -> ")[0]), t))]
        else:
            continue
        if not waits or None in waits:
            continue
        ready = max(e for p in waits for _, e in p["spans"].values())
        start = min(s for s, _ in r["spans"].values())
        if start <= ready or any(ready < e < start or ready < s < start
                                 for d in r["spans"] for s, e in busy[int(d)]):
            continue  # queued behind other work: not the master's doing
        out.append(start - ready)
    return out


def run_plan(experiment: str, graph: DataflowGraph, name: str, plan: ExecutionPlan, iterations: int, warmup: int,
             base: Path, tag: str) -> Run:
    run_dir = base / f"{''.join(ch if ch.isalnum() else '_' for ch in name)}-{tag}"
    plan_path = base / f"{run_dir.name}.plan.json"
    plan.save(plan_path)
    cmd = [sys.executable, "-m", "realloc.cli", "run", experiment, "--plan", str(plan_path), "--iterations",
           str(iterations), "--run-dir", str(run_dir), "--quiet"]
    load0 = os.getloadavg()[0]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "TMPDIR": str(base)})
    seconds = time.time() - t0
    load1 = os.getloadavg()[0]
    if r.returncode != 0:
        raise RuntimeError(f"plan {name!r} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = [m for m in metrics if m["iteration"] > warmup]  # iterations count from 1
    its = {m["iteration"] for m in steady}
    calls: dict[str, dict[int, float]] = {}
    realloc = {t: 0.0 for t in its}
    data = {t: 0.0 for t in its}
    requests = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    for rec in requests:
        t = rec["iteration"]
        if t not in its or not rec["spans"]:
            continue
        work = request_time(rec["spans"])
        if rec["kind"] == "call":
            calls.setdefault(rec["label"], {})[t] = work
        elif rec["kind"] == "realloc":
            realloc[t] += work
        elif rec["kind"] == "data":
            data[t] += work
    return Run(name, run_dir, [m["iteration_time"] for m in steady],
               {c: list(v.values()) for c, v in calls.items()}, list(realloc.values()), list(data.values()),
               dispatch_latencies(graph, requests, its), (load0, load1), seconds)


# -- report ----------------------------------------------------------------------------------------------------

def rel(est: float, meas: float) -> float:
    return (est - meas) / meas if meas > 0 else float("nan")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


@dataclasses.dataclass
class PlanResult:
    name: str
    est: Estimate
    runs: list[Run]

    @property
    def measured(self) -> float:
        """The fastest repeat's median iteration: this host's other tenants only ever add time (the
        reason timeit reports a minimum), and the profiles were taken on the quiet machine."""
        return min(r.time for r in self.runs)

    @property
    def median_run(self) -> float:
        return med([r.time for r in self.runs])

    @property
    def spread(self) -> float:
        """Half the range of the repeats' medians, relative to their median."""
        ts = [r.time for r in self.runs]
        return (max(ts) - min(ts)) / 2 / self.median_run if len(ts) > 1 else 0.0

    @property
    def error(self) -> float:
        return rel(self.est.time, self.measured)

    @property
    def error_median_run(self) -> float:
        return rel(self.est.time, self.median_run)

    def _fastest_run(self, values) -> float:
        """Per repeat, the median of ``values(run)`` over its iterations; the smallest of those."""
        per_run = [med(xs) for xs in map(values, self.runs) if xs]
        return min(per_run) if per_run else 0.0

    def call_measured(self, call: str) -> float:
        return self._fastest_run(lambda r: r.calls.get(call, []))

    def realloc_measured(self) -> float:
        return self._fastest_run(lambda r: r.realloc)

    def data_measured(self) -> float:
        return self._fastest_run(lambda r: r.data)

    def latency_measured(self) -> float:
        return med([x for r in self.runs for x in r.latency])


def plan_line(p: ExecutionPlan, calls: tuple[str, ...]) -> str:
    out = []
    for c in calls:
        x = p.placements[c]
        out.append(f"{c} {x.mesh} {x.dp}/{x.tp}/{x.pp}x{x.n_mbs}")
    return ", ".join(out)


def print_report(spec: ExperimentSpec, graph: DataflowGraph, results: list[PlanResult], args: argparse.Namespace,
                 profile_note: str) -> dict:
    calls = graph.topo_order
    print(f"\n{spec.name}: batch {spec.batch_size}, prompt {spec.prompt_len} + generation {spec.gen_len} tokens, "
          f"on {spec.cluster.nodelist} ({spec.cluster.n_devices} {spec.cluster.device} devices); {profile_note}")
    print(f"measured: median over iterations {args.warmup + 1}..{args.iterations} of each run; 'meas.' is the "
          f"fastest of {args.repeats} run(s) per plan (other tenants of this host only add time), 'median run' "
          f"the middle one; spread = half the range of the runs' medians\n")
    header = (f"{'plan':<22}{'est. s/it':>10}{'meas. s/it':>11}{'error':>8}{'median run':>11}{'error':>8}"
              f"{'spread':>8}{'load':>11}{'dispatch ms':>13}{'2-proc slowdown':>17}")
    print(header)
    print("-" * len(header))
    for r in results:
        loads = [x for run in r.runs for x in run.load]
        slow = [run.probe[1] / run.probe[0] - 1 for run in r.runs if run.probe[0] > 0]
        print(f"{r.name:<22}{r.est.time:>10.3f}{r.measured:>11.3f} {r.error:>+7.1%}{r.median_run:>11.3f} "
              f"{r.error_median_run:>+7.1%}{r.spread:>7.1%} "
              f"{min(loads):>6.2f}-{max(loads):<4.2f}{r.latency_measured() * 1e3:>9.2f}"
              f"{'   ' + ', '.join(f'{x:+.0%}' for x in slow):>17}")
    lat = med([x for r in results for run in r.runs for x in run.latency])
    print("(2-proc slowdown: a fixed matmul loop on two processes at once vs alone, probed before each run; the "
          "profiles assume 0%)")
    print(f"(dispatch: median delay from the end of the call a request waited for to its start on idle devices, "
          f"{lat * 1e3:.2f} ms over all plans; the model uses {graph.spec.cluster.hardware.dispatch_latency * 1e3:.2f} "
          f"ms)")
    errs = [abs(r.error) for r in results]
    print("\nper call: estimated / measured ms (error); realloc and data: seconds per iteration. A request's "
          "measured time runs from when all its devices had started it to its end")
    head = f"{'plan':<22}" + "".join(f"{c[:16]:>22}" for c in calls) + f"{'realloc':>20}{'data':>20}"
    print(head)
    print("-" * len(head))
    for r in results:
        cells = []
        for c in calls:
            e, m = r.est.calls[c] * 1e3, r.call_measured(c) * 1e3
            cells.append(f"{e:7.1f}/{m:7.1f} ({rel(e, m):+4.0%})")
        cells.append(f"{r.est.realloc:6.3f}/{r.realloc_measured():6.3f}")
        cells.append(f"{r.est.data:6.3f}/{r.data_measured():6.3f}")
        print(f"{r.name:<22}" + "".join(f"{x:>22}" for x in cells[:-2]) + f"{cells[-2]:>20}{cells[-1]:>20}")
    errs_mid = [abs(r.error_median_run) for r in results]
    summary = {"median_error": statistics.median(errs), "max_error": max(errs), "plans": len(results),
               "median_error_median_run": statistics.median(errs_mid), "max_error_median_run": max(errs_mid)}
    print(f"\nerror over {len(results)} plans: median {summary['median_error']:.1%}, max {summary['max_error']:.1%} "
          f"(target: median <= 10%, max <= 20%); against the median run: median "
          f"{summary['median_error_median_run']:.1%}, max {summary['max_error_median_run']:.1%}")
    by = {r.name: r for r in results}
    if "searched" in by and "heuristic" in by:
        s, h = by["searched"], by["heuristic"]
        est_speed, meas_speed = h.est.time / s.est.time, h.measured / s.measured
        mid_speed = h.median_run / s.median_run
        summary.update(est_speedup=est_speed, measured_speedup=meas_speed, measured_speedup_median_run=mid_speed)
        print(f"searched vs heuristic: estimated speedup {est_speed:.2f}x, measured {meas_speed:.2f}x "
              f"({rel(est_speed, meas_speed):+.1%}; median runs {mid_speed:.2f}x, {rel(est_speed, mid_speed):+.1%})")
    best = min(results, key=lambda r: r.measured)
    print(f"fastest measured plan: {best.name} ({best.measured:.3f} s/it)")
    print("\nplans (call mesh dp/tp/pp x micro-batches):")
    for r in results:
        print(f"  {r.name}: {plan_line(r.est.plan, calls)}")
    return summary


# -- picture ---------------------------------------------------------------------------------------------------

def draw(results: list[PlanResult], timeline_plan: str, graph: DataflowGraph, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(16, 9))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.1, 1])
    ax = fig.add_subplot(grid[0, :])
    x = np.arange(len(results))
    ax.bar(x - 0.2, [r.est.time for r in results], 0.4, label="estimated", color="tab:blue")
    ax.bar(x + 0.2, [r.measured for r in results], 0.4, label="measured", color="tab:orange",
           yerr=[r.spread * r.measured for r in results], capsize=3)
    for i, r in enumerate(results):
        ax.text(i, max(r.est.time, r.measured) * 1.03, f"{r.error:+.0%}", ha="center", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([r.name for r in results], rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per iteration (log)")
    ax.set_title(f"{graph.spec.name}: estimated vs measured steady-state iteration time per plan")
    ax.legend()

    res = next(r for r in results if r.name == timeline_plan)
    first, last = res.est.space.problem.priced_window
    n_it = last - first
    est = estimated_panel(res.est.space, res.est.indices, res.est.plan, iterations=n_it, skip=first + 1,
                          title=f"estimated: {res.name}, {n_it} steady iterations ({res.est.time:.3f} s/it)")
    run = min(res.runs, key=lambda r: abs(r.time - res.measured))
    steady_its = range(run_first_iteration(run), run_first_iteration(run) + n_it)
    requests = [json.loads(line) for line in (run.run_dir / "requests.jsonl").read_text().splitlines()]
    meas = measured_panel(requests, res.est.plan, graph, steady_its,
                          title=f"measured: {res.name}, iterations {steady_its.start}..{steady_its.stop - 1} "
                                f"({res.measured:.3f} s/it, fastest repeat)")
    span = max(est.span, meas.span)
    ax_e = fig.add_subplot(grid[1, 0])
    ax_m = fig.add_subplot(grid[1, 1], sharex=ax_e)
    for a, panel in ((ax_e, est), (ax_m, meas)):
        draw_panel(a, panel, span)
        a.set_xlabel("seconds")
    ax_e.set_xlim(0, span * 1.02)
    ax_m.legend(handles=legend_handles([est, meas]), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_first_iteration(run: Run) -> int:
    metrics = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return metrics[-len(run.iteration_times)]["iteration"]


# -- profiling -------------------------------------------------------------------------------------------------

def profile_commands(model_types: set[str]) -> list[str]:
    """The ``realloc profile`` commands of profiles/cpu/README.md for these model types."""
    out = []
    for line in PROFILE_README.read_text().splitlines():
        line = line.strip()
        if line.startswith("realloc profile"):
            words = shlex.split(line)
            if words[words.index("--model") + 1] in model_types:
                out.append(line)
    return out


def profile_machine(graph: DataflowGraph) -> None:
    from realloc.models.config import CRITIC_SUFFIX

    types = {t.removesuffix(CRITIC_SUFFIX) for t in graph.model_types.values()}
    for cmd in profile_commands(types):
        print(f"$ {cmd}", file=sys.stderr, flush=True)
        words = shlex.split(cmd)
        subprocess.run([sys.executable, "-m", "realloc.cli", *words[1:]], check=True, cwd=REPO)


def profile_note(cost: CostModel) -> str:
    notes = []
    for t in cost.profiles:
        meta = t.meta
        load = meta.get("load_average_before")
        notes.append(f"{t.model_type} profiled {str(meta.get('created', '?'))[:16]} (load {load[0] if load else '?'})")
    return "; ".join(notes) or "no profile (roofline)"


# -- main ------------------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--search-time", type=float, default=10.0)
    p.add_argument("--plans", default="", help="comma-separated subset of plan names")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="use the profiles in profiles/cpu/ instead of profiling this machine first")
    p.add_argument("--timeline-plan", default="searched")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    if args.warmup >= args.iterations:
        raise SystemExit("--warmup must be smaller than --iterations")
    experiment = str((REPO / args.experiment).resolve()) if not Path(args.experiment).is_absolute() else args.experiment
    spec = load_experiment(experiment)
    graph = build_graph(spec)
    if args.profile:
        profile_machine(graph)
    cost = CostModel(graph)
    print(f"searching ({args.search_time:.0f} s) ...", file=sys.stderr, flush=True)
    report = plan_search(spec, args.search_time, cost=cost)
    plans = {"searched": report.plan, "heuristic": baseline(spec, "heuristic", cost)}
    for name in ("colocate-dp", "split"):
        plans[name] = baseline(spec, name, cost)
    plans.update(hand_plans(spec, graph))
    if args.plans:
        keep = [x.strip() for x in args.plans.split(",")]
        plans = {k: v for k, v in plans.items() if k in keep}
    estimates = {name: estimate(graph, cost, plan) for name, plan in plans.items()}
    base = Path(tempfile.mkdtemp(prefix="estimator_accuracy_"))
    runs: dict[str, list[Run]] = {name: [] for name in plans}
    try:
        for rep in range(args.repeats):
            order = list(plans) if rep % 2 == 0 else list(reversed(plans))
            for name in order:
                print(f"run {rep + 1}/{args.repeats}: {name} (estimated {estimates[name].time:.3f} s/it) ...",
                      file=sys.stderr, flush=True)
                probe = probe_machine()
                run = run_plan(experiment, graph, name, plans[name], args.iterations, args.warmup, base, str(rep))
                run.probe = probe
                runs[name].append(run)
                print(f"  measured {run.time:.3f} s/it in {run.seconds:.0f} s, load {run.load[0]:.2f}"
                      f"->{run.load[1]:.2f}, probe {probe[0] * 1e3:.0f}/{probe[1] * 1e3:.0f} ms",
                      file=sys.stderr, flush=True)
        results = [PlanResult(name, estimates[name], runs[name]) for name in plans]
        summary = print_report(spec, graph, results, args, profile_note(cost))
        out = Path(args.out)
        pic = draw(results, args.timeline_plan if args.timeline_plan in plans else next(iter(plans)), graph,
                   out / f"estimator_accuracy_{spec.name}.png")
        print(f"picture: {pic}")
        (out / f"estimator_accuracy_{spec.name}.json").write_text(json.dumps({
            "summary": summary, "plans": {r.name: {"estimated": r.est.time, "measured": r.measured,
                                                   "median_run": r.median_run, "spread": r.spread,
                                                   "error": r.error,
                                                   "runs": [run.time for run in r.runs]} for r in results}},
            indent=1))
    finally:
        if args.keep:
            print(f"run directories: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
