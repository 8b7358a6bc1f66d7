"""Long-tail migration and streaming (issue 31; docs/streaming.md), measured on the 2-device local CPU cluster.

PPO (actor, reference and critic of model ``--model``, a rule reward) with lengths from the seeded EOS schedule,
lognormal with p99 16x the median. Generation runs at dp 2 over both devices. Plans, each one ``realloc run``:

- ``unfused, inference dp 2``: no tail entry; the inference calls at dp 2 over both devices (the natural plan
  without fusion); the actor trains at dp 2, the critic on device 1 in every plan;
- ``unfused, inference on dev 1``: no tail entry; the inference calls on device 1 only (the fused plan's placement);
- ``fused R_t=k``: the same with ``tail = {actor_gen: (k, 1)}``: once at most k rows run, they move to replica 0 and
  the inference calls on device 1 start on the finished rows; a sweep over k.

Measured per iteration (median over the iterations after the first): generation + inference, from the generation's
dispatch to the end of the last inference request (``requests.jsonl``), the whole iteration (``metrics.jsonl``), and
the inference calls' work done before the generation ended (seconds of their requests' spans; what streaming overlaps).
The plans run in turn, ``--repeats`` rounds; each plan's best round counts (on a shared machine the load drifts).
Estimated: the plan's estimated iteration time and the generation's and inference calls' estimates from the
estimator of this branch, which does not price the tail (the planner side of issue 31 does): both plans get the
unfused estimate.

    .venv/bin/python benchmarks/bench_fusion.py [--model small --rows 32 --gen-len 128 --iterations 4 --repeats 2]
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

REPO = Path(__file__).resolve().parents[1]
INFERENCE = ("rew_inf", "ref_inf", "critic_inf")

EXPERIMENT = '''
import dataclasses
import importlib.util

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, ResponseLengths, auto

_spec = importlib.util.spec_from_file_location("ppo_tiny", {base!r})
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size={rows}, prompt_len=8, gen_len={gen_len},
      response_lengths=ResponseLengths.lognormal(median={median}, p99={gen_len}))
@dataclasses.dataclass
class FusionPPO(_base.TinyPPO):
    dataset: str = {data!r}
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=2e-3, critic_lr=2e-3, kl_coef=0.01,
                               length_schedule=ResponseLengths.lognormal(median={median}, p99={gen_len}))

    @property
    def rpcs(self):
        out = []
        for r in super().rpcs:
            if r.model_type in ("tiny", "tiny-critic"):
                r = dataclasses.replace(r, model_type=r.model_type.replace("tiny", {model!r}))
            out.append(r)
        return out
'''


def _plans(graph, sweep: list[int]):
    from realloc.graph.plan import ExecutionPlan

    def places(inference_mesh: tuple):
        # the critic trains where the fused plan infers with it, so no reallocation of it waits for device 0
        out = {c: (inference_mesh if c in INFERENCE else ("localhost", 2, 1, 1, 1)) for c in graph.spec.call_names}
        return {**out, "critic_train": ("localhost:1", 1, 1, 1, 1)}

    plans = {"unfused, inference dp 2": ExecutionPlan.by_hand(graph, places(("localhost", 2, 1, 1, 1)), source="hand"),
             "unfused, inference on dev 1": ExecutionPlan.by_hand(graph, places(("localhost:1", 1, 1, 1, 1)),
                                                                  source="hand")}
    for k in sweep:
        plans[f"fused R_t={k}"] = ExecutionPlan.by_hand(graph, places(("localhost:1", 1, 1, 1, 1)), source="hand",
                                                        tail={"actor_gen": (k, 1)})
    return plans


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


def _estimate(graph, plan) -> tuple[float, float, bool]:
    """The estimator's iteration time for ``plan``'s placements, and its generation + inference: generation, then
    the inference calls (side by side at dp 2, or one after another on device 1); for a fused plan, with the
    planner's tail pricing where this checkout has it (``estimator/tail_cost.py``): phase 1, then the tail beside
    the consumers' part 1, then their part 2. The flag says whether the tail was priced."""
    from realloc.estimator.cost import CostModel
    from realloc.search.timeline import estimate_plan

    cost = CostModel(graph)
    space, idx = estimate_plan(graph, plan, cost)
    est = space.to_plan(idx, "estimate")
    gen_inf = est.call_times["actor_gen"] + sum(est.call_times[c] for c in INFERENCE)
    tail = plan.tail.get("actor_gen")
    if tail is None:
        return float(est.estimated_time or 0.0), gen_inf, False
    try:
        from realloc.estimator.tail_cost import consumer_parts, tail_generation_cost
    except ImportError:
        return float(est.estimated_time or 0.0), gen_inf, False
    cluster, p = graph.spec.cluster, plan.placements["actor_gen"]
    g = tail_generation_cost(cost, "actor_gen", cluster.mesh(p.mesh), p.strategy, p.n_mbs, tail.rows, tail.instances)
    parts = [consumer_parts(cost, c, "actor_gen", cluster.mesh(plan.placements[c].mesh), plan.placements[c].strategy,
                            plan.placements[c].n_mbs, tail.rows) for c in INFERENCE]
    part1, part2 = sum(x[0] for x in parts), sum(x[1] for x in parts)
    return float(est.estimated_time or 0.0), g.phase1 + max(g.tail, part1) + part2, True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--sweep", default="2,4,8,16", help="R_t values, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the plans; each plan's best round counts")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this folder")
    p.add_argument("--only", default=None, help="run only the plans whose name contains this")
    args = p.parse_args()
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.lengths import ResponseLengths
    from realloc.models.length_schedule import scheduled_lengths
    from realloc.models.weights import param_seed

    median = max(1, args.gen_len // 16)
    sweep = [int(x) for x in args.sweep.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        exp = Path(tmp) / "fusion_ppo.py"
        exp.write_text(EXPERIMENT.format(base=str(REPO / "experiments/ppo_tiny.py"), rows=args.rows,
                                         gen_len=args.gen_len, median=median, model=args.model,
                                         data=str(REPO / "experiments/data/ppo_tiny_prompts.jsonl")))
        graph = build_graph(load_experiment(str(exp)))
        env = {**os.environ, "TMPDIR": tmp, "PYTHONPATH": str(REPO)}
        plans = {n: p for n, p in _plans(graph, sweep).items() if not args.only or args.only in n}
        measured: dict[str, list[tuple[float, float]]] = {n: [] for n in plans}
        for rep in range(args.repeats):  # the plans in turn, every round: a shared machine's load drifts
            for name, plan in plans.items():
                path = Path(tmp) / "plan.json"
                plan.save(path)
                run_dir = Path(tmp) / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}_{rep}"
                r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir),
                                    "--quiet", "--plan", str(path), "--iterations", str(args.iterations),
                                    "--no-final-checkpoint"], capture_output=True, text=True, env=env, timeout=1800)
                if r.returncode:
                    print(r.stdout + r.stderr)
                    return 1
                measured[name].append(_measure(run_dir))
        rows, priced_tail = [], False
        for name, plan in plans.items():  # each plan's best round: the least disturbed by other load
            rows.append((name, *min(measured[name]), *_estimate(graph, plan)))
            priced_tail = priced_tail or rows[-1][-1]
    lens = scheduled_lengths(ResponseLengths.lognormal(median=median, p99=args.gen_len), args.gen_len,
                             param_seed(1, "generate/0"), range(args.rows))
    s = sorted(lens)
    print(f"PPO, model {args.model} x3 on 2 CPU devices (gloo, 1 thread each), {args.rows} rows of 8 prompt tokens, "
          f"lengths lognormal median {median}, p99 {args.gen_len} (iteration 1: median {s[len(s) // 2]}, max {s[-1]}); "
          f"{args.iterations} iterations, medians over 2..{args.iterations}, the best of {args.repeats} rounds")
    print(f"{'plan':<28}{'gen+inf s':>10}{'iter s':>9}{'inf in gen':>11}{'est iter':>10}{'est g+i':>9}")
    for name, gi, it, ov, est_it, est_gi, _ in rows:
        print(f"{name:<28}{gi:>10.3f}{it:>9.3f}{ov:>11.3f}{est_it:>10.3f}{est_gi:>9.3f}")
    base = min((r for r in rows if r[0].startswith("unfused")), key=lambda r: r[1], default=None)
    best = min((r for r in rows if r[0].startswith("fused")), key=lambda r: r[1], default=None)
    if base is None or best is None:
        return 0
    print(f"best measured R_t: {best[0].split('=')[1]} of {args.rows} rows")
    print(f"fused ({best[0]}) vs the faster unfused plan ({base[0]}): generation + inference "
          f"{base[1] / best[1]:.2f}x, iteration {base[2] / best[2]:.2f}x")
    if not priced_tail:
        print("estimates: this checkout's estimator does not price the tail (estimator/tail_cost.py), so fused plans "
              "show the unfused estimate of their placements")
    else:
        print("estimates: gen+inf of fused plans priced with estimator/tail_cost.py; iteration estimates as "
              "estimate_plan prices the placements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
