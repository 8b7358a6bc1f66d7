"""The multi-turn rollout call (issue 34, item 4): estimated against measured, on the CPU calc demo.

1. The tool SFT model of the calc demo (``experiments/calc_sft.py``, 150 iterations; ``--sft DIR`` reuses one).
2. Profile runs: ``experiments/calc_grpo_tool.py`` for 3 iterations with every rollout logged, under each of three
   plans; a run's ``samples.jsonl`` (turn segments) and ``metrics.jsonl`` (the environment's seconds per step)
   give the turn profile, as ``realloc search --lengths-from RUN_DIR`` reads it.
3. Measured runs under the three plans with another seed: the GENERATE call's time (``requests.jsonl``, the
   slowest rank, iterations after the first) next to the estimate of that plan's placement, priced from the dp2
   plan's profile run (what a search prices every plan with), from the same plan's, and from the measured run's
   own turns and the tool seconds of its measured iterations ("self"). On a shared machine the load moves between
   the runs; the self column prices the call with the tool time of the same minutes, so it shows the estimator's
   error without that drift. Then each turn's generation and environment, estimated (self) against measured.

    .venv/bin/python benchmarks/bench_multiturn_plan.py [--sft runs/calc_demo/sft_tool] [--iterations 4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANS = {  # call -> (mesh, dp, tp, pp, n_mbs)
    "dp2": {"actor_gen": ("localhost", 2, 1, 1, 1), "ref_inf": ("localhost", 2, 1, 1, 1),
            "actor_train": ("localhost", 2, 1, 1, 1)},
    "dp1, one device": {c: ("localhost:0", 1, 1, 1, 1) for c in ("actor_gen", "ref_inf", "actor_train")},
    "dp1, 4 micro-batches": {"actor_gen": ("localhost:0", 1, 1, 1, 4), "ref_inf": ("localhost:1", 1, 1, 1, 1),
                             "actor_train": ("localhost:1", 1, 1, 1, 1)},
}


def _realloc(args: list[str], tmp: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "realloc.cli", *args], capture_output=True, text=True,
                       env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)})
    if r.returncode:
        raise RuntimeError(f"realloc {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def _experiment(tmp: Path, seed: int) -> Path:
    """calc_grpo_tool.py logging every rollout (its paths made absolute), with ``seed``."""
    src = (REPO / "experiments" / "calc_grpo_tool.py").read_text()
    src = src.replace('"data/', f'"{REPO}/experiments/data/').replace("    seed: int = 1", f"    seed: int = {seed}")
    src = src.replace('    init: str = ""', '    sample_every: int = 1\n    log_samples: int = 128\n    init: str = ""')
    path = tmp / f"calc_tool_seed{seed}.py"
    path.write_text(src)
    return path


def _run(experiment: Path, run_dir: Path, plan: Path | None, iterations: int, sft: Path, tmp: Path) -> None:
    _realloc(["run", str(experiment), "--run-dir", str(run_dir), "--iterations", str(iterations), "--quiet",
              "--set", f"init={sft}", *(["--plan", str(plan)] if plan else ["--search-time", "2"])], tmp)


def _call_times(run_dir: Path, call: str) -> list[float]:
    """The call's seconds per iteration after the first: its slowest rank's span."""
    out = []
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "call" and r["label"] == call and r["iteration"] > 1 and r["spans"]:
            out.append(max(e - s for s, e in r["spans"].values()))
    return out


def _measured_stats(run_dir: Path, call: str) -> list[dict]:
    """The call's stats of the measured iterations (after the first), as ``metrics.jsonl`` logged them."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["calls"][call] for r in recs if r["iteration"] > 1]


def _self_profile(spec, run_dir: Path, call: str):
    """The run's own turn profile, its tool seconds per step taken from the measured iterations alone: the first
    iteration is not measured, and its tool steps ran at another moment's load."""
    from realloc.envs.turn_profile import with_profile
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.lengths import lengths_from_run
    from realloc.search.turns_report import turns_from

    mine = turns_from(dataclasses.replace(spec, response_lengths=lengths_from_run(run_dir)), run_dir)
    prof = CostModel(build_graph(mine)).rollout_shape(call).profile
    stats = _measured_stats(run_dir, call)
    per = {k: sum(s[f"env_{k}_s"] for s in stats) / max(1.0, sum(s[f"env_{k}_steps"] for s in stats))
           for k in ("obs", "final")}
    return with_profile(mine, [call], dataclasses.replace(prof, step_s=per["obs"], final_s=per["final"]))


def _turn_lines(cost, name: str, run_dir: Path, mesh, p) -> list[str]:
    """Each turn's generation and environment seconds on one dp rank: estimated (self) against measured (the
    stats' ``turn<k>_generate_s`` / ``turn<k>_env_s``, summed over the replicas, so divided by dp)."""
    stats, dp = _measured_stats(run_dir, "actor_gen"), p.strategy.dp
    out = []
    for t in cost.turns("actor_gen", mesh, p.strategy, p.n_mbs):
        gen = statistics.mean(s[f"turn{t.turn}_generate_s"] for s in stats) / dp
        env = statistics.mean(s[f"turn{t.turn}_env_s"] for s in stats) / dp
        out.append(f"  {name}, turn {t.turn}: generation est {t.generate.time:.3f} s, measured {gen:.3f} s; "
                   f"environment est {t.env_s:.3f} s, measured {env:.3f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft", default=None, help="the tool SFT model's export (default: train it, ~2 min)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--keep", default=None, help="keep the runs in this directory (default: a temporary one)")
    args = ap.parse_args()
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan, validate_plan
    from realloc.lengths import lengths_from_run
    from realloc.overrides import load_with_overrides
    from realloc.search.turns_report import profile_lines, turns_from

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        tmp = Path(args.keep or d)
        tmp.mkdir(parents=True, exist_ok=True)
        sft = Path(args.sft).resolve() if args.sft else tmp / "sft_tool"
        if not args.sft:
            _realloc(["run", str(REPO / "experiments" / "calc_sft.py"), "--run-dir", str(tmp / "sft_run"),
                      "--iterations", "150", "--quiet", "--search-time", "2"], tmp)
            _realloc(["export", str(tmp / "sft_run"), "--model", "actor", "--out", str(sft)], tmp)
        seeded = {seed: _experiment(tmp, seed) for seed in (1, 2)}
        costs, plans = {}, {}
        for name, placements in PLANS.items():
            spec = load_with_overrides(str(seeded[2]), [f"init={sft}"])
            plans[name] = ExecutionPlan.by_hand(build_graph(spec), placements, source=name)
            path = tmp / f"{name.replace(' ', '_').replace(',', '')}.json"
            plans[name].save(path)
            profile = tmp / f"profile-{path.stem}"
            _run(seeded[1], profile, path, 3, sft, tmp)
            priced = turns_from(dataclasses.replace(spec, response_lengths=lengths_from_run(profile)), profile)
            costs[name] = CostModel(build_graph(priced))
        graph = costs["dp2"].graph
        print(f"calc demo, GRPO with the calculator tool: 16 prompts x 8 rollouts, at most 2 turns of 16 tokens; "
              f"load average {load:.1f} at the start")
        for name, cost in costs.items():
            print(f"profile of the {name} run: " + profile_lines(cost.graph)[0].split(": ", 1)[1])
        print(f"{'plan (actor_gen)':<22}{'measured s':>11}{'range':>12}{'est. (dp2 profile)':>20}{'est/meas':>9}"
              f"{'est. (own profile)':>20}{'est/meas':>9}{'est. (self)':>13}{'est/meas':>9}{'tool ms':>9}")
        breakdown: list[str] = []
        for name, plan in plans.items():
            run_dir = tmp / f"measured-{name.replace(' ', '_').replace(',', '')}"
            plan.save(tmp / "plan.json")
            _run(seeded[2], run_dir, tmp / "plan.json", args.iterations, sft, tmp)
            times = _call_times(run_dir, "actor_gen")
            p = plan.placements["actor_gen"]
            mesh = validate_plan(plan, graph)["actor_gen"]
            costs["self"] = CostModel(build_graph(_self_profile(spec, run_dir, "actor_gen")))
            shared, own, self_ = (costs[k].call_cost("actor_gen", mesh, p.strategy, p.n_mbs).time
                                  for k in ("dp2", name, "self"))
            step_ms = float(profile_lines(costs["self"].graph)[0].split(" ms per tool step")[0].rsplit(" ", 1)[1])
            meas = statistics.mean(times)
            print(f"{name:<22}{meas:>11.2f}{f'{min(times):.2f}-{max(times):.2f}':>12}{shared:>20.2f}{shared / meas:>9.2f}"
                  f"{own:>20.2f}{own / meas:>9.2f}{self_:>13.2f}{self_ / meas:>9.2f}{step_ms:>9.0f}")
            breakdown += _turn_lines(costs["self"], name, run_dir, mesh, p)
        print("where the time goes, per dp rank (self estimate against measured, iterations 2 on):")
        print("\n".join(breakdown))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
