"""Streaming without migration (issue 31 item 2; docs/tail-semantics.md), measured on the 2-device local CPU cluster.

PPO (``bench_fusion.py``'s experiment and settings: ``--setting rm``, actor, reference, critic and a learned reward
model, all of model ``small``, or ``rule``, a rule reward instead of the reward model; lengths
from the seeded EOS schedule, lognormal with p99 16x the median) in FlexRLHF's disaggregated placement: generation
on device 0, the inference calls on device 1, the train steps over both. Plans, each one ``realloc run``:

- ``disaggregated``: no tail entry; the inference calls wait for the whole generation;
- ``streamed R=k``: the same with ``tail = {actor_gen: (k, 0)}``: once at most k rows run, the finished rows go to
  device 1 and the inference calls run on them while device 0 decodes the rest; a sweep over k;
- ``colocated dp 2`` (context): generation and inference at dp 2 over both devices, no entry.

Measured per iteration (median over the iterations after the first): generation + inference, from the generation's
dispatch to the end of the last inference request (``requests.jsonl``), the iteration (``metrics.jsonl``), and the
inference work done before the generation ended (what streaming overlaps). The plans run in turn, ``--repeats``
rounds; each plan's best round counts. Estimated: the planner's simulator (``estimate_plan``, the schedule of an
iteration in the steady state) for the same span and for the iteration.

    .venv/bin/python benchmarks/bench_streaming.py [--setting rm|rule --rows 32 --gen-len 128 --iterations 4 --repeats 2]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fusion import INFERENCE, REPO, workload_args, write_experiment  # noqa: E402 - the same experiment as the fusion benchmark

GEN = "actor_gen"


def _plans(graph, sweep: list[int]):
    from realloc.graph.plan import ExecutionPlan

    both, dev0, dev1 = ("localhost", 2, 1, 1, 1), ("localhost:0", 1, 1, 1, 1), ("localhost:1", 1, 1, 1, 1)
    apart = {c: dev0 if c == GEN else dev1 if c in INFERENCE else both for c in graph.spec.call_names}
    apart["critic_train"] = dev1  # the critic trains where it infers: no reallocation of it waits for device 0
    plans = {"disaggregated": ExecutionPlan.by_hand(graph, apart, source="hand")}
    for k in sweep:
        plans[f"streamed R={k}"] = ExecutionPlan.by_hand(graph, apart, source="hand", tail={GEN: (k, 0)})
    plans["colocated dp 2"] = ExecutionPlan.by_hand(graph, {**apart, GEN: both, **{c: both for c in INFERENCE}},
                                                    source="hand")
    return plans


def _measure(run_dir: Path) -> tuple[float, float, float]:
    """Medians over iterations 2.. of generation + inference wall time, iteration time, and the seconds of inference
    work done before the generation's last request ended."""
    reqs = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines() if x.strip()]
    calls = [r for r in reqs if r.get("kind") == "call"]
    gen_inf, overlap = [], []
    for it in sorted({r["iteration"] for r in calls})[1:]:
        gen = [r for r in calls if r["iteration"] == it and r["label"] == GEN]  # two requests when streamed
        inf = [r for r in calls if r["iteration"] == it and r["label"] in INFERENCE]
        start, end = min(r["dispatched"] for r in gen), max(r["completed"] for r in gen)
        gen_inf.append(max(r["completed"] for r in inf) - start)
        overlap.append(sum(max(0.0, min(b, end) - a) for r in inf for a, b in r["spans"].values()))
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return (statistics.median(gen_inf), statistics.median(m["iteration_time"] for m in metrics[1:]),
            statistics.median(overlap))


def _estimate(graph, plan) -> tuple[float, float]:
    """The simulator's iteration time for ``plan`` and its generation + inference span in a middle iteration."""
    from realloc.search.reference import CALL
    from realloc.search.tail_reference import PART
    from realloc.search.timeline import estimate_plan

    space, idx = estimate_plan(graph, plan)
    ev = space.evaluate(idx)
    names = space.problem.call_names
    gen, inf = names.index(GEN), {names.index(c) for c in INFERENCE}
    recs = space.cpp.schedule(idx)
    mid = max(r[3] for r in recs) // 2
    start = min(r[4] for r in recs if r[3] == mid and r[1] == gen and r[0] == CALL)  # the generation's call node
    end = max(r[5] for r in recs if r[3] == mid and r[1] in inf and r[0] in (CALL, PART))  # a consumer's parts
    return float(ev["time"]), end - start


def main() -> int:
    p = workload_args(__doc__)
    p.add_argument("--sweep", default="4,8", help="R values (rows still running at the split), comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the plans; each plan's best round counts")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this folder")
    args = p.parse_args()
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph

    median = max(1, args.gen_len // 16)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        exp = Path(tmp) / "stream_ppo.py"
        write_experiment(exp, args.setting, args.rows, args.gen_len)
        graph = build_graph(load_experiment(str(exp)))
        env = {**os.environ, "TMPDIR": tmp, "PYTHONPATH": str(REPO)}
        plans = _plans(graph, [int(x) for x in args.sweep.split(",")])
        measured: dict[str, list[tuple[float, float, float]]] = {n: [] for n in plans}
        for rep in range(args.repeats):  # the plans in turn, every round: a shared machine's load drifts
            for name, plan in plans.items():
                path = Path(tmp) / "plan.json"
                plan.save(path)
                run_dir = Path(tmp) / f"{name.replace(' ', '_').replace('=', '')}_{rep}"
                r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir),
                                    "--quiet", "--plan", str(path), "--iterations", str(args.iterations),
                                    "--no-final-checkpoint"], capture_output=True, text=True, env=env, timeout=1800)
                if r.returncode:
                    print(r.stdout + r.stderr)
                    return 1
                measured[name].append(_measure(run_dir))
        rows = [(name, *min(measured[name]), *_estimate(graph, plan)) for name, plan in plans.items()]
    print(f"PPO, setting {args.setting} on 2 CPU devices (gloo, 1 thread each), {args.rows} rows, lengths lognormal "
          f"median {median}, p99 {args.gen_len}; {args.iterations} iterations, medians over 2..{args.iterations}, "
          f"the best of {args.repeats} rounds")
    print(f"{'plan':<18}{'gen+inf s':>10}{'iter s':>9}{'inf in gen':>11}{'est g+i':>9}{'est/meas':>9}{'est iter':>10}"
          f"{'est/meas':>9}")
    for name, gi, it, ov, est_it, est_gi in rows:
        print(f"{name:<18}{gi:>10.3f}{it:>9.3f}{ov:>11.3f}{est_gi:>9.3f}{est_gi / gi:>9.2f}{est_it:>10.3f}"
              f"{est_it / it:>9.2f}")
    base = rows[0]
    best = min((r for r in rows if r[0].startswith("streamed")), key=lambda r: r[1])
    print(f"streamed ({best[0]}) vs disaggregated: generation + inference {base[1] / best[1]:.2f}x, iteration "
          f"{base[2] / best[2]:.2f}x (estimated {base[5] / best[5]:.2f}x and {base[4] / best[4]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
