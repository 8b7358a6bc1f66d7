"""Dry runs of heterogeneous clusters (docs/heterogeneous.md): the searched plan on two pools next to the best
plan on the strongest pool alone, by the estimator (no GPU is used).

    .venv/bin/python benchmarks/bench_heterogeneous.py                 # four settings, ~30 s of search each
    .venv/bin/python benchmarks/bench_heterogeneous.py --search-time 60

Settings: FlexRLHF Table III (experiments/ppo_33b_a100_v100.py: PPO of four LLaMA-33B models with LoRA, 8
A100-80G + 8 V100-32G; the paper measured 0.69 -> 0.79 samples/s, +14.5%, against DeepSpeed-Chat on the A100s),
synchronous and with generation up to one train step ahead (eta <= 1, both plans searched under that bound),
and GRPO 8B with 8 H100s training beside 8 H20s or 8 L40Ss (experiments/grpo_h100_h20.py, grpo_h100_l40s.py);
Table III and H100 + H20 synchronous also with long-tailed response lengths (lognormal, p99 16x the median, at most
the experiment's gen_len) beside their fixed lengths.
``realloc search EXP`` spends a third of its time on the strongest pool alone and starts the two-pool search
from that plan, so the two-pool plan is never slower by the estimate; the table says by how much it is faster,
and how both compare with the heuristic plan (realhf.txt §8's Megatron-style baseline) on the strongest pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from realloc.api import ResponseLengths, load_experiment  # noqa: E402
from realloc.search.planner import plan_search  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (title, experiment, paper's number, max_staleness to search with: None keeps the experiment's, response lengths:
# None keeps the experiment's)
SETTINGS = (
    ("FlexRLHF Table III: 33B PPO, 8 A100 + 8 V100", "experiments/ppo_33b_a100_v100.py", "+14.5% (0.69 -> 0.79)",
     None, None),
    # FlexRLHF's shadow actors generate while training goes on and take the trained weights periodically: what
    # realloc calls bounded staleness; the same setting searched with generation up to one step ahead
    ("the same, eta <= 1", "experiments/ppo_33b_a100_v100.py", "+14.5% (0.69 -> 0.79)", 1, None),
    # responses that end at their EOS, not all at 256 tokens: rows finish at different steps and stream across the
    # pools as they finish (docs/heterogeneous.md, "Streaming across pools")
    ("Table III, lengths lognormal (median 128, p99 256)", "experiments/ppo_33b_a100_v100.py",
     "+14.5% (0.69 -> 0.79)", None, ResponseLengths.lognormal(median=128, p99=256)),
    # long-tailed responses (p99 16x the median, the longest at the cap), synchronous (issue 32's dry runs with
    # streaming and fusion allowed): beside the fixed-length rows of the same cluster
    ("Table III, long tail (lognormal median 16, p99 256)", "experiments/ppo_33b_a100_v100.py",
     "+14.5% (0.69 -> 0.79)", None, ResponseLengths.lognormal(median=16, p99=256)),
    ("GRPO 8B, 8 H100 + 8 H20 (eta <= 1)", "experiments/grpo_h100_h20.py", "-", None, None),
    ("GRPO 8B, 8 H100 + 8 H20, synchronous", "experiments/grpo_h100_h20.py", "-", 0, None),
    ("GRPO 8B, H100 + H20, sync., long tail (64/1024)", "experiments/grpo_h100_h20.py", "-", 0,
     ResponseLengths.lognormal(median=64, p99=1024)),
    ("GRPO 8B, 8 H100 + 8 L40S (eta <= 1)", "experiments/grpo_h100_l40s.py", "-", None, None),
)


def pools_of(report) -> str:
    """Which calls the two-pool plan puts on which pool."""
    by_pool: dict[int, list[str]] = {}
    for c, name in enumerate(report.space.problem.call_names):
        by_pool.setdefault(report.space.options[c][int(report.indices[c])].mesh.pool, []).append(name)
    cluster = report.spec.cluster
    return "; ".join(f"{cluster.pools[p].device}: {', '.join(calls)}" for p, calls in sorted(by_pool.items()))


def long_run(space, indices, iterations: int) -> float:
    """The plan's s/iteration over a long run, the cross-check of the planner's window (docs/search.md, "The price
    of a plan"): ``iterations`` unrolled, the first quarter left out as warm-up, the planner's lookahead after."""
    p = space.problem
    warmup = p.warmup + iterations // 4
    steps = (iterations - warmup - p.lookahead - 1) // 6 * 6  # a schedule repeating every 1, 2, 3 or 6 averages exactly
    problem = dataclasses.replace(p, n_iterations=warmup + steps + 1 + p.lookahead, warmup=warmup).to_cpp()
    return problem.evaluate(np.asarray(indices, np.int32))["time"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search-time", type=float, default=30.0, help="seconds of search per setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-run", type=int, default=64, metavar="K",
                    help="also price both plans over a long run of K unrolled iterations (default 64)")
    ap.add_argument("--only", default=None, help="run the settings whose title contains this text")
    args = ap.parse_args()
    rows = []
    for title, path, paper, staleness, lengths in SETTINGS:
        if args.only and args.only not in title:
            continue
        spec = load_experiment(str(ROOT / path))
        if staleness is not None:
            spec = dataclasses.replace(spec, max_staleness=staleness)
        if lengths is not None:
            spec = dataclasses.replace(spec, response_lengths=lengths)
        report = plan_search(spec, args.search_time, seed=args.seed)
        alone, both = report.alone.plan.estimated_time, report.plan.estimated_time
        heur = report.alone.baselines["heuristic"]
        heur_t = heur.plan.estimated_time if heur.plan is not None and heur.fits else None
        long = (long_run(report.alone.space, report.alone.indices, args.long_run),
                long_run(report.space, report.indices, args.long_run))
        rows.append((title, alone, both, heur_t, paper, pools_of(report), long))
        tails = "; ".join(f"{c}: {t}" for c, t in report.plan.tail.items()) or "no tail"
        print(f"{title}: {pools_of(report)} ({tails}; alone: {dict(report.alone.plan.tail) or 'no tail'})",
              flush=True)
    print()
    header = (f"{'setting':<48}{'strong pool alone s/it':>24}{'two pools s/it':>16}{'gain':>8}"
              f"{'heuristic (strong pool) s/it':>30}{'two pools vs heuristic':>24}"
              f"{f'long run ({args.long_run} iterations)':>30}  paper")
    print(header)
    print("-" * len(header))
    for title, alone, both, heur_t, paper, _, (long_alone, long_both) in rows:
        vs = f"{heur_t / both:.2f}x" if heur_t else "-"
        heur_s = f"{heur_t:.2f}" if heur_t else "n/a"
        long = f"{long_alone:.2f} -> {long_both:.2f} (+{100 * (long_alone / long_both - 1):.1f}%)"
        print(f"{title:<48}{alone:>24.2f}{both:>16.2f}{f'+{100 * (alone / both - 1):.1f}%':>8}{heur_s:>30}{vs:>24}"
              f"{long:>30}  {paper}")


if __name__ == "__main__":
    main()
