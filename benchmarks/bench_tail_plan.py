"""Planning the long tail at RLHFuse's settings (issue 31 item 3; rlhfuse.txt §7, Figs. 7-8): a dry run.

For each actor/critic pair of experiments/rlhfuse_*.py (LLaMA 13B/33B, 33B/13B, 33B/65B, 65B/33B; 32 nodes of 8
Hopper GPUs, batch 512) and each maximum generation length (512, 1024, 2048; lognormal lengths, median gen_len / 16,
p99 0.8 gen_len: 12.8x the median), the search runs twice: without migration (realloc's own ReaLHF-style plan),
then with long-tail migration as a plan choice, starting from the first plan, then once more without migration
from both plans' placements (so that the gain is the migration's, not a longer search's). Printed per setting: both estimated
iterations, the chosen R_t, m and chunks, the generation + inference span of a steady-state iteration (from the start of
the generation to the end of the last inference call, reward, reference and critic, parts included) of both
plans, and the gains beside the paper's (Fig. 8: generation + inference 1.2-1.6x with migration; Fig. 7: the
iteration 1.4-2.4x over ReaLHF, with its training-stage fusion too).

To keep a setting within minutes on a laptop-class CPU the placements are those of whole nodes with up to 8
micro-batches (``--all-meshes`` searches every mesh).

    .venv/bin/python benchmarks/bench_tail_plan.py [--search-time 20] [--pairs 13b_33b,65b_33b] [--gen 512,1024]
    .venv/bin/python benchmarks/bench_tail_plan.py --max-evals 1000000 --search-time 120  # same on a loaded box
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.lengths import ResponseLengths
from realloc.search.build import PlanSpace
from realloc.search.engine import run_mcmc
from realloc.search.tail_report import gen_inf_span
from realloc.search.tail_space import without_tails

PAIRS = ("13b_33b", "33b_13b", "33b_65b", "65b_33b")
GEN_LENS = (512, 1024, 2048)


def run(pair: str, gen_len: int, search_time: float, all_meshes: bool, max_evals: int | None = None) -> dict:
    base = load_experiment(f"experiments/rlhfuse_{pair}.py")
    spec = dataclasses.replace(base, gen_len=gen_len,
                               response_lengths=ResponseLengths.lognormal(median=gen_len / 16, p99=gen_len * 0.8))
    graph = build_graph(spec)
    cost = CostModel(graph)
    per_node = spec.cluster.n_devices_per_node
    keep = None if all_meshes else (lambda c, o: o.mesh.n_devs == per_node and o.n_mbs <= 8)
    t0, c0 = time.perf_counter(), time.process_time()
    space = PlanSpace.build(graph, cost, option_filter=keep, max_n_mbs=8)
    built, built_cpu = time.perf_counter() - t0, time.process_time() - c0
    plain, _ = without_tails(space, [])
    budget = dict(time_limit=search_time, max_evals=max_evals)
    a = run_mcmc(plain, **budget, seed=0, n_threads=1, n_chains=2, starts=[plain.fastest()])
    no_tail = plain.to_plan(a.indices, "search")
    start = space.indices_of(no_tail)
    b = run_mcmc(space, **budget, seed=0, n_threads=1, n_chains=2, starts=[start])
    plan = space.to_plan(b.indices, "search")
    # the plan without migration searched once more, also from the winner's placement (so that the gain is the
    # migration's, not a longer search's)
    placed = plain.indices_of(plan.model_copy(update={"tail": {}}))
    c = run_mcmc(plain, **budget, seed=1, n_threads=1, n_chains=2, starts=[a.indices, placed])
    if c.evaluation["cost"] < a.evaluation["cost"]:
        no_tail = plain.to_plan(c.indices, "search")
    start = space.indices_of(no_tail)
    t = plan.tail.get("actor_gen")
    return dict(pair=pair, gen=gen_len, built=built, built_cpu=built_cpu, no_tail=no_tail.estimated_time,
                tail=plan.estimated_time, rows=t.rows if t else 0, m=t.instances if t else 0,
                chunks=t.chunks if t else 0,
                dp=plan.placements["actor_gen"].dp, span0=gen_inf_span(space, start),
                span1=gen_inf_span(space, b.indices))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search-time", type=float, default=20.0, help="seconds per search (two per setting)")
    ap.add_argument("--pairs", default=",".join(PAIRS))
    ap.add_argument("--gen", default=",".join(map(str, GEN_LENS)))
    ap.add_argument("--all-meshes", action="store_true")
    ap.add_argument("--max-evals", type=int, default=None,
                    help="evaluations per search, the same on a loaded machine (--search-time then caps each)")
    args = ap.parse_args()
    print("RLHFuse settings, 32 x 8 h100-80g, batch 512, lognormal lengths (median gen/16, p99 0.8 gen); estimated s")
    print(f"{'actor/critic':<13}{'gen':>6}{'no mig.':>9}{'migr.':>9}{'R_t':>5}{'m/dp':>7}{'k':>3}{'gen+inf':>9}"
          f"{'migr.':>8}"
          f"{'g+i gain':>9}{'iter gain':>10}   paper: g+i 1.2-1.6x, iter 1.4-2.4x (vs ReaLHF)")
    for pair in args.pairs.split(","):
        for g in map(int, args.gen.split(",")):
            r = run(pair, g, args.search_time, args.all_meshes, args.max_evals)
            name = pair.replace("_", "/").upper()
            print(f"{name:<13}{g:>6}{r['no_tail']:>9.2f}{r['tail']:>9.2f}{r['rows']:>5}{r['m']:>4}/{r['dp']:<2}"
                  f"{r['chunks']:>3}{r['span0']:>9.2f}{r['span1']:>8.2f}{r['span0'] / r['span1']:>8.2f}x"
                  f"{r['no_tail'] / r['tail']:>9.2f}x   (built in {r['built']:.0f} s, {r['built_cpu']:.0f} s CPU)",
                  flush=True)


if __name__ == "__main__":
    main()
