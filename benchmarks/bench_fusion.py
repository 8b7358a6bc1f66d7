"""Long-tail migration and streaming (issue 31; docs/streaming.md), measured on the 2-device local CPU cluster.

PPO with lengths from the seeded EOS schedule, lognormal with p99 16x the median, in one of two settings:

- ``--setting rm`` (the default; RLHFuse's workload shape, rlhfuse.txt §7): actor, reference, critic and a learned
  reward model (``interface_impl="reward"``, a model that scores each sequence), all of model ``small``: the
  inference stage is three forward passes of the actor's size, as in ReaLHF's and RLHFuse's PPO, whose critic and
  reward model are as large as the actor or larger (13B actor / 33B critic in RLHFuse's Figs. 7-8). The CPU
  cluster's two model sizes are 30x apart in parameters, so "as large" is the nearest it comes to "larger": a
  ``tiny`` actor's tail would be far too short to hide a ``small`` critic's and reward model's inference.
- ``--setting rule``: the same with a rule reward (no reward model), so the inference stage is two passes (the
  setting of the first measurements in docs/streaming.md).
- ``--setting fit``: the workload where fusion's premise holds on two devices (docs/streaming.md, "A workload
  where fusion pays"): actor and reference ``tiny``, critic and reward model ``mid``, sized from measured per-device
  times so that the inference on one device about equals the generation's tail. It runs bench_chunked.py's
  comparison (the search's fused plan, the best unfused plans, the R_t sweep on the searched placement, RLHFuse's
  migration on the colocated plan) with ``balance_tokens`` on, and prints the max/min tokens per dp rank; it takes
  bench_chunked.py's options (``--repeats``, ``--search-time``, ``--profiles DIR``).
- ``--setting long``: the same comparison on a longer batch (docs/streaming.md, "A longer batch"): 128 rows of
  32-token prompts, lengths lognormal median 4 and p99 128, all four models ``tiny``; RLHFuse's migration on the
  colocated plan at R_t 5, 10 and 20% (also in ``fit``), and its estimated best R_t against the measured one.

Plans, each one ``realloc run``; generation and the actor's training at dp 2 over both devices in all of them:

- ``unfused``: the inference calls and the critic's training at dp 2 over both devices (the natural plan without
  migration); ``unfused, critic dev 1``: the same with the critic training on device 1, where the next
  iteration's generation may start on device 0 while it trains;
- ``fused R_t=k``: the inference calls and the critic's training on device 1 and ``tail = {actor_gen: (k, 1)}``:
  once at most k rows still decode, they move to replica 0 (device 0) and the inference calls start on device 1
  on the finished rows, then run on the tail rows when the generation ends; k over the search's grid (5, 10, 20,
  30, 40% of the rows). The critic trains where it infers, so no reallocation into its inference waits for the
  tail's device.

Measured per iteration (median over the iterations after the first; each plan's best of ``--repeats`` rounds, the
plans in turn every round, since a shared machine's load drifts): generation + inference, from the generation's
dispatch to the end of the last inference request (``requests.jsonl``), the whole iteration (``metrics.jsonl``), and
the inference work done before the generation ended (what streaming overlaps). Estimated: the iteration and the
generation + inference span of a middle iteration of the simulator's schedule (``search/timeline.estimate_plan``,
``search/tail_report.gen_inf_span``), which prices the migration (``estimator/tail_cost.py``). The planner's R_t
is the grid R_t whose fused plan has the smallest estimated iteration (what the search chooses on this placement).

``--breakdown`` also prints where each plan's iteration goes, measured (medians over iterations 2..; the tail
replica's phase 1, migration (rows packed + all-gather + the caches' transfer, if they move) and phase 2 (with a
re-run prefill, if not) from its worker log, the rest from ``requests.jsonl``) beside the estimate (``tail_cost.tail_generation_cost`` and the simulator's schedule):
generation, inference before and after the generation's end, training, and the rest (transfers, reallocations,
request overheads, idle devices).

    .venv/bin/python benchmarks/bench_fusion.py [--setting rm|rule --rows 32 --gen-len 128 --iterations 4 --repeats 2
                                                 --breakdown]
    .venv/bin/python benchmarks/bench_fusion.py --setting fit --repeats 2 [--profiles DIR]
    .venv/bin/python benchmarks/bench_fusion.py --setting long --repeats 2 [--profiles DIR --rows --prompt --median]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
INFERENCE = ("rew_inf", "ref_inf", "critic_inf")
TARGET_TOKENS = list(range(16, 32))

EXPERIMENT = '''
import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import ResponseLengths, auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size={rows}, prompt_len={prompt},
      gen_len={gen_len}, response_lengths=ResponseLengths.lognormal(median={median}, p99={gen_len}))
@dataclasses.dataclass
class FusionPPO:
    seed: int = 1
    dataset: str = {data!r}
    iterations: int = 4
    balance_tokens: bool = {balance}
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=1e-3, critic_lr=1e-3, kl_coef=0.01,
                               length_schedule=ResponseLengths.lognormal(median={median}, p99={gen_len}))

    @property
    def rpcs(self):
        return ppo_rpcs(actor={actor!r}, critic={critic!r}, reward={reward!r}, n_minibatches=self.ppo.n_minibatches,
                        reward_impl={impl!r}, reward_args={args!r})
'''

SETTINGS = {  # reward model type, interface, arguments
    "rm": ("small-critic", "reward", {}),
    "rule": ("rule", "rule_reward", {"rule": "token_set", "tokens": TARGET_TOKENS}),
}


def write_experiment(path: Path, setting: str, rows: int, gen_len: int, actor: str = "small",
                     critic: str = "small-critic", balance_tokens: bool = False, median: int | None = None,
                     prompt: int = 8) -> None:
    """The experiment file of a setting (also bench_streaming.py's and bench_chunked.py's): PPO with lengths
    lognormal, median ``median`` (default gen_len / 16), p99 gen_len, on prompts of ``prompt`` tokens (the shipped
    8-token prompts, or 512 seeded random prompts of that length written beside the experiment)."""
    reward, impl, rargs = SETTINGS[setting]
    median = median or max(1, gen_len // 16)
    data = REPO / "experiments/data/ppo_tiny_prompts.jsonl"
    if prompt != 8:
        rng = random.Random(prompt)
        data = path.with_name(f"prompts_{prompt}.jsonl")
        data.write_text("".join(json.dumps({"prompt": [rng.randrange(64) for _ in range(prompt)]}) + "\n"
                                for _ in range(512)))
    path.write_text(EXPERIMENT.format(rows=rows, gen_len=gen_len, median=median, actor=actor,
                                      critic=critic, reward=critic if reward == "small-critic" else reward, impl=impl,
                                      args=rargs, balance=balance_tokens,
                                      prompt=prompt, data=str(data)))


def _plans(graph, grid: list[int]):
    from realloc.graph.plan import ExecutionPlan

    def places(inference_mesh: tuple, critic_mesh: tuple):
        out = {c: (inference_mesh if c in INFERENCE else ("localhost", 2, 1, 1, 1)) for c in graph.spec.call_names}
        return {**out, "critic_train": critic_mesh}

    both, dev1 = ("localhost", 2, 1, 1, 1), ("localhost:1", 1, 1, 1, 1)
    plans = {"unfused": ExecutionPlan.by_hand(graph, places(both, both), source="hand"),
             "unfused, critic dev 1": ExecutionPlan.by_hand(graph, places(both, dev1), source="hand")}
    for k in grid:  # the critic trains where it infers: no reallocation into critic_inf waits for the tail's device
        plans[f"fused R_t={k}"] = ExecutionPlan.by_hand(graph, places(dev1, dev1), source="hand",
                                                        tail={"actor_gen": (k, 1)})
    return plans


def _tail_phases(run_dir: Path) -> dict[str, float]:
    """Medians over iterations 2.. of the tail replica's phases (worker 0's ``tail dp rank 0`` lines)."""
    import re

    got: dict[str, list[float]] = {}
    lines = [x for x in (run_dir / "logs" / "worker0.log").read_text().splitlines() if "tail dp rank 0:" in x][1:]
    for line in lines:
        for name, sec in re.findall(r"(phase 1|rows packed|all-gather|caches moved|phase 2|replay) ([0-9.]+) s", line):
            got.setdefault(name, []).append(float(sec))
    return {k: statistics.median(v) for k, v in got.items()}


def _parts(run_dir: Path) -> dict[str, float]:
    """The measured breakdown (bench_chunked.breakdown, medians over iterations 2..) and the tail's phases."""
    from bench_chunked import _measured

    return {**_measured(run_dir)[2], **_tail_phases(run_dir)}


def _measure(run_dir: Path) -> tuple[float, float, float]:
    """Medians over iterations 2.. of generation + inference wall time, iteration time, and the seconds of inference
    work done before the generation ended (the overlap streaming buys; 0 without a tail entry)."""
    reqs = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines() if x.strip()]
    calls = [r for r in reqs if r.get("kind") == "call"]
    its = sorted({r["iteration"] for r in calls})[1:]
    gen_inf, overlap = [], []
    for it in its:
        gen = next(r for r in calls if r["iteration"] == it and r["label"] == "actor_gen")
        inf = [r for r in calls if r["iteration"] == it and r["label"] in INFERENCE]
        gen_inf.append(max(r["completed"] for r in inf) - gen["dispatched"])
        overlap.append(sum(max(0.0, min(b, gen["completed"]) - a) for r in inf for a, b in r["spans"].values()))
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return (statistics.median(gen_inf), statistics.median(m["iteration_time"] for m in metrics[1:]),
            statistics.median(overlap))


def _estimate(graph, plan) -> tuple[float, float]:
    """The estimated iteration and generation + inference span of ``plan`` (with its migration, if any)."""
    from realloc.estimator.cost import CostModel
    from realloc.search.tail_report import gen_inf_span
    from realloc.search.timeline import estimate_plan

    space, idx = estimate_plan(graph, plan, CostModel(graph))
    return float(space.to_plan(idx, "estimate").estimated_time or 0.0), gen_inf_span(space, idx)


def run_plan(exp: Path, plan, run_dir: Path, iterations: int, env: dict) -> None:
    """``realloc run`` of ``exp`` under ``plan`` into ``run_dir`` (also bench_chunked.py's)."""
    path = run_dir.parent / "plan.json"
    plan.save(path)
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet",
                        "--plan", str(path), "--iterations", str(iterations), "--no-final-checkpoint"],
                       capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)


def _run(exp: Path, plan, run_dir: Path, iterations: int, env: dict, parts: dict | None = None
         ) -> tuple[float, float, float]:
    run_plan(exp, plan, run_dir, iterations, env)
    if parts is not None:
        parts[str(run_dir)] = _parts(run_dir)
    return _measure(run_dir)


def _estimated_parts(graph, plan) -> dict[str, float]:
    """The estimated breakdown: the simulator's schedule (bench_chunked._estimated) and the tail's priced phases."""
    from bench_chunked import _estimated

    from realloc.estimator.cost import CostModel
    from realloc.estimator.tail_cost import tail_generation_cost

    out = dict(_estimated(graph, plan)[2])
    for call, t in plan.tail.items():
        p = plan.placements[call]
        cost = CostModel(graph)
        tc = tail_generation_cost(cost, call, graph.spec.cluster.mesh(p.mesh), p.strategy, p.n_mbs, t.rows,
                                  t.instances)
        out.update({"phase 1": tc.phase1, "migration": tc.migration, "phase 2": tc.phase2})
    return out


def print_breakdown(names: list[str], measured: dict[str, dict[str, float]], estimated: dict[str, dict[str, float]]
                    ) -> None:
    keys = ("gen", "phase 1", "migration", "phase 2", "inf in gen", "inf after", "train", "other")
    print("breakdown, measured (estimated), seconds per iteration: " + " | ".join(keys))
    for name in names:
        m, e = measured.get(name, {}), estimated[name]
        if "phase 1" in m:  # the migration as the tail replica ran it: rows packed, all-gather, caches moved
            m = {**m, "migration": m.get("rows packed", 0.0) + m.get("all-gather", 0.0) + m.get("caches moved", 0.0)}
        cells = [f"{m[k]:.3f} ({e[k]:.3f})" if k in e and k in m else "-" for k in keys]
        print(f"  {name:<23}" + " | ".join(cells))


def workload_args(doc: str | None) -> argparse.ArgumentParser:
    """The workload's options, shared with bench_streaming.py."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(SETTINGS), default="rm",
                   help="(bench_fusion.py also takes --setting fit and long: bench_chunked.py's comparison, see above)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--iterations", type=int, default=4)
    return p


def main() -> int:
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--setting")
    setting = pick.parse_known_args()[0].setting
    if setting in ("fit", "long"):  # the searched plans, bench_chunked.py's comparison
        from bench_chunked import chunked_args, compare

        return compare(chunked_args(__doc__, setting).parse_args(), chunked=False, balance_tokens=True)
    p = workload_args(__doc__)
    p.add_argument("--repeats", type=int, default=2, help="rounds over the plans; each plan's best round counts")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this folder")
    p.add_argument("--estimate-only", action="store_true", help="print the estimates without running")
    p.add_argument("--breakdown", action="store_true", help="print where each plan's iteration goes")
    args = p.parse_args()
    from realloc.api import load_experiment
    from realloc.estimator.tail_cost import TAIL_GRID, tail_rows
    from realloc.graph.dataflow import build_graph
    from realloc.lengths import ResponseLengths
    from realloc.models.length_schedule import scheduled_lengths
    from realloc.models.weights import param_seed

    median = max(1, args.gen_len // 16)
    grid = [tail_rows(args.rows, share) for share in TAIL_GRID]
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        exp = tmp / f"fusion_ppo_{args.setting}.py"
        write_experiment(exp, args.setting, args.rows, args.gen_len)
        graph = build_graph(load_experiment(str(exp)))
        plans = _plans(graph, grid)
        est = {n: _estimate(graph, plan) for n, plan in plans.items()}
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
        measured: dict[str, list[tuple[float, float, float]]] = {n: [] for n in plans}
        parts: dict[str, dict[str, float]] = {}
        for rep in range(0 if args.estimate_only else args.repeats):
            for name, plan in plans.items():
                run_dir = tmp / f"{args.setting}_{name.replace(' ', '_').replace('=', '')}_{rep}"
                measured[name].append(_run(exp, plan, run_dir, args.iterations, env, parts))
                if min(measured[name], key=lambda m: m[1]) is measured[name][-1]:
                    parts[name] = parts.pop(str(run_dir))  # the breakdown of the plan's best round
    lens = sorted(scheduled_lengths(ResponseLengths.lognormal(median=median, p99=args.gen_len), args.gen_len,
                                    param_seed(1, "generate/0"), range(args.rows)))
    what = {"rm": "actor, reference, critic and a learned reward model, all of model small",
            "rule": "actor, reference and critic of model small, a rule reward"}[args.setting]
    print(f"setting {args.setting}: PPO, {what}; 2 CPU devices (gloo, 1 thread each); {args.rows} rows of 8 prompt "
          f"tokens, lengths lognormal median {median}, p99 {args.gen_len} (iteration 1: median {lens[len(lens) // 2]}, "
          f"max {lens[-1]}); {args.iterations} iterations, medians over 2..{args.iterations}, "
          f"the best of {args.repeats} rounds")
    print(f"{'plan':<23}{'gen+inf s':>10}{'est':>8}{'est/meas':>9}{'iter s':>9}{'est':>8}{'est/meas':>9}"
          f"{'inf in gen':>11}")
    rows = {}
    for name in plans:
        gi, it, ov = min(measured[name]) if measured[name] else (float("nan"),) * 3
        e_it, e_gi = est[name]
        rows[name] = (gi, it, e_gi, e_it)
        print(f"{name:<23}{gi:>10.3f}{e_gi:>8.3f}{e_gi / gi:>9.2f}{it:>9.3f}{e_it:>8.3f}{e_it / it:>9.2f}{ov:>11.3f}")
    if args.breakdown:
        print_breakdown(list(plans), parts, {n: _estimated_parts(graph, plan) for n, plan in plans.items()})
    fused = [n for n in plans if n.startswith("fused")]
    planner = min(fused, key=lambda n: rows[n][3])
    ran = not args.estimate_only

    def fastest_unfused(col: int) -> str:  # by the measured column (the estimated one without runs)
        return min((n for n in plans if n.startswith("unfused")), key=lambda n: rows[n][col if ran else col + 2])

    base_gi, base_it = fastest_unfused(0), fastest_unfused(1)

    def share(name: str) -> str:
        k = grid[fused.index(name)]
        return f"{k} ({TAIL_GRID[grid.index(k)]:.0%})"

    def ratios(name: str) -> str:
        r, g, i = rows[name], rows[base_gi], rows[base_it]
        return (f"generation + inference {g[0] / r[0]:.2f}x measured, {g[2] / r[2]:.2f}x estimated; "
                f"iteration {i[1] / r[1]:.2f}x measured, {i[3] / r[3]:.2f}x estimated")

    print(f"the faster unfused plan{'' if ran else ' (estimated)'}: by generation + inference '{base_gi}', "
          f"by iteration '{base_it}'; each ratio below is against the faster one")
    print(f"the planner's R_t (the smallest estimated iteration on this placement): {share(planner)}; by estimated "
          f"generation + inference: {share(min(fused, key=lambda n: rows[n][2]))}")
    print(f"fused at the planner's R_t vs unfused: {ratios(planner)}")
    if ran:
        for what, col in (("iteration", 1), ("generation + inference", 0)):
            best = min(fused, key=lambda n: rows[n][col])
            print(f"best measured R_t by {what}: {share(best)}, {abs(fused.index(best) - fused.index(planner))} grid "
                  f"step(s) from the planner's; fused at it vs unfused: {ratios(best)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
