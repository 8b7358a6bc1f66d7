"""Fused pipeline schedule search on the settings of rlhfuse.txt Table 3, next to the paper's numbers.

    .venv/bin/python benchmarks/bench_fused_schedule.py            # 12 settings, one process
    .venv/bin/python benchmarks/bench_fused_schedule.py --iterations 40000 --restarts 4

Setting: the larger model (A) on PP0 stages, the smaller (B) on PP1 stages in the reverse direction,
n/PP1 pipelines of B when PP1 < PP0 (the paper's fusion factor), GBS micro-batches of A and
GBS / (n / PP1) per pipeline of B. A stage's forward time and activation are proportional to the
model's parameters per stage, backward = 2 x forward, no p2p time: the paper gives no more.
Speed-ups and memory are relative to the two models' serial 1F1B runs (memory: the largest
per-device activation peak); "paper" columns are Table 3's Greedy / Ours / LB.
"""

from __future__ import annotations

import argparse
import time

from realloc import _C

SIZE_B = {"65B": 65.0, "33B": 33.0, "13B": 13.0}

# (A, B, PP0, PP1, GBS): paper's (greedy, ours, LB) speed-ups and (greedy, ours) memory ratios
TABLE3 = {
    ("33B", "13B", 8, 4, 8): (1.29, 1.38, 1.38, 1.51, 1.0),
    ("33B", "13B", 8, 4, 16): (1.12, 1.30, 1.30, 2.14, 1.0),
    ("33B", "13B", 8, 4, 32): (1.10, 1.15, 1.15, 2.75, 1.26),
    ("33B", "13B", 8, 8, 8): (1.4, 1.4, 1.4, 1.51, 1.0),
    ("33B", "13B", 8, 8, 16): (1.15, 1.32, 1.32, 2.00, 1.19),
    ("33B", "13B", 8, 8, 32): (1.08, 1.17, 1.17, 2.75, 1.31),
    ("65B", "33B", 16, 8, 16): (1.28, 1.48, 1.48, 1.61, 1.0),
    ("65B", "33B", 16, 8, 32): (1.14, 1.27, 1.27, 2.23, 1.0),
    ("65B", "33B", 16, 8, 64): (1.12, 1.15, 1.15, 2.88, 1.26),
    ("65B", "33B", 16, 16, 16): (1.27, 1.5, 1.5, 1.57, 1.0),
    ("65B", "33B", 16, 16, 32): (1.16, 1.33, 1.33, 2.00, 1.22),
    ("65B", "33B", 16, 16, 64): (1.09, 1.16, 1.17, 2.88, 1.47),
}


def problem(a: str, b: str, pp0: int, pp1: int, gbs: int) -> _C.FusedProblem:
    n = pp0
    fa, fb = SIZE_B[a] / pp0, SIZE_B[b] / pp1
    return _C.FusedProblem(n, pp0, gbs, [fa] * pp0, [2 * fa] * pp0, [fa] * pp0,
                           pp1, gbs // (n // pp1), [fb] * pp1, [2 * fb] * pp1, [fb] * pp1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--memory-iterations", type=int, default=10000)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reach", type=int, default=None, help="places one move may carry a pass")
    ap.add_argument("--t-start", type=float, default=None, help="start temperature / start energy")
    ap.add_argument("--t-end", type=float, default=None)
    ap.add_argument("--timeline", default=None, help="draw the 65B/33B PP 16/8 GBS 16 schedule here (.svg/.png/.html)")
    ap.add_argument("--memory-cap", type=float, default=None,
                    help="cap every device's activations at this multiple of the serial 1F1B peak")
    args = ap.parse_args()
    head = (f"{'models':8} {'PP0/PP1':>7} {'GBS':>4} | {'start':>5} {'ours':>5} {'LB':>5} {'ours/LB':>7} | "
            f"{'paper ours':>10} {'ours/paper':>10} | {'mem start':>9} {'mem ours':>8} {'paper':>5} | {'s':>5}")
    print(head)
    print("-" * len(head))
    t_all = time.perf_counter()
    for (a, b, pp0, pp1, gbs), (_, p_ours, _, _, p_mem) in TABLE3.items():
        t = time.perf_counter()
        p = problem(a, b, pp0, pp1, gbs)
        cap = float("inf")
        if args.memory_cap is not None:
            cap = args.memory_cap * p.search(iterations=0, memory_iterations=0, restarts=1)["serial"]["peak"]
        tuning = {k: v for k, v in (("reach", args.reach), ("t_start", args.t_start), ("t_end", args.t_end))
                  if v is not None}  # else the engine's defaults
        r = p.search(memory_cap=cap, iterations=args.iterations, memory_iterations=args.memory_iterations,
                     restarts=args.restarts, seed=args.seed, **tuning)
        serial, peak = r["serial"]["makespan"], r["serial"]["peak"]
        ours, lb = serial / r["eval"]["makespan"], serial / r["lower_bound"]
        print(f"{a + '/' + b:8} {f'{pp0}/{pp1}':>7} {gbs:>4} | {serial / r['start']['makespan']:5.2f} {ours:5.2f} "
              f"{lb:5.2f} {ours / lb:7.3f} | {p_ours:10.2f} {ours / p_ours:10.3f} | "
              f"{r['start']['peak'] / peak:9.2f} {r['eval']['peak'] / peak:8.2f} {p_mem:5.2f} | "
              f"{time.perf_counter() - t:5.1f}", flush=True)
    print(f"total {time.perf_counter() - t_all:.1f} s (one thread)")
    if args.timeline:
        draw(args.timeline, ("65B", "33B", 16, 8, 16), args.iterations)


def draw(path: str, setting: tuple[str, str, int, int, int], iterations: int) -> None:
    """RLHFuse Figure 10's setting: the searched schedule as a timeline, one row per device."""
    from realloc.search.fused_reference import RefModel, RefProblem
    from realloc.search.fused_report import fused_panel
    from realloc.search.timeline import write_timeline

    a, b, pp0, pp1, gbs = setting
    n, fa, fb = pp0, SIZE_B[a] / pp0, SIZE_B[b] / pp1
    ref = RefProblem(n, RefModel(pp0, gbs, [fa] * pp0, [2 * fa] * pp0, [fa] * pp0),
                     RefModel(pp1, gbs // (n // pp1), [fb] * pp1, [2 * fb] * pp1, [fb] * pp1))
    r = problem(*setting).search(iterations=iterations)
    panel = fused_panel(ref, [[tuple(p) for p in s] for s in r["order"]], (a, b),
                        f"{a}/{b} PP {pp0}/{pp1}, {gbs} micro-batches: fused makespan {r['eval']['makespan']:.1f} "
                        f"(serial {r['serial']['makespan']:.1f}, bound {r['lower_bound']:.1f})")
    print(f"timeline: {write_timeline([panel], path)}")


if __name__ == "__main__":
    main()
