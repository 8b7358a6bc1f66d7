"""A lower bound on any synchronous plan of a two-pool cluster (docs/heterogeneous.md, "How far can two pools go"):
what the search's own candidates allow, for every split of the calls between the pools.

    .venv/bin/python benchmarks/bench_pool_bound.py                      # FlexRLHF Table III (33B, A100 + V100)
    .venv/bin/python benchmarks/bench_pool_bound.py --alone 17.93         # and the gain it allows over that plan

For a split a (call -> pool), every plan that places the calls so has a steady-state iteration T of at least:

- per pool p, its device-seconds over its devices: each device runs each call of an iteration once per iteration,
  so T >= sum over the calls on p of min over their candidates on p of (devices x seconds) / (devices of p).
  Streaming only cuts a call into parts, each priced at least at its rows' share (a decode or forward step on
  fewer rows costs no less per row); a long-tail migration would free devices before its generation ends, so the
  bound is for fixed response lengths, where the search offers none (Table III's setting);
- per dependency cycle of a synchronous iteration, its calls' shortest candidates in a row: the actor's
  generation of t + 1 reads the parameters its train step of t wrote, which read the generation of t
  (T >= gen + actor_train, the inference between them hidden at best by streaming), and the critic's inference
  of t + 1 reads the critic its train step of t wrote (T >= critic_inf + critic_train).

Reallocations and transfers cost >= 0 and are left out, so the bound holds for every plan of the split in the
search's space (the candidates the search keeps: those that fit their pool's memory). The smallest bound over the
splits bounds every synchronous plan of the cluster.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realloc.api import load_experiment  # noqa: E402
from realloc.estimator.cost import CostModel  # noqa: E402
from realloc.graph.dataflow import build_graph  # noqa: E402
from realloc.search.build import PlanSpace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (first, second): a cycle of a synchronous iteration through these two calls (the module docstring)
CYCLES = (("actor_gen", "actor_train"), ("critic_inf", "critic_train"))


def call_minima(space: PlanSpace, n_pools: int) -> tuple[dict, dict]:
    """Per (call, pool): the shortest candidate's seconds and the fewest device-seconds of any candidate (plain
    candidates, no tail rows)."""
    t_min: dict[tuple[str, int], float] = {}
    d_min: dict[tuple[str, int], float] = {}
    for c, name in enumerate(space.problem.call_names):
        for i, o in enumerate(space.options[c]):
            if space.tail_of(c, i) is not None:
                continue
            key, t = (name, o.mesh.pool), float(space.problem.candidates[c].time[i])
            t_min[key] = min(t_min.get(key, float("inf")), t)
            d_min[key] = min(d_min.get(key, float("inf")), t * o.mesh.size)
    return t_min, d_min


def bounds(space: PlanSpace, sizes: list[int]) -> list[tuple[float, tuple[int, ...], str]]:
    """(bound, split, what binds) for every split of the calls between the pools, smallest first."""
    names = space.problem.call_names
    t_min, d_min = call_minima(space, len(sizes))
    out = []
    for split in itertools.product(range(len(sizes)), repeat=len(names)):
        where = dict(zip(names, split))
        if any((n, where[n]) not in t_min for n in names):
            continue  # a call with no candidate on that pool (none fits)
        terms = {f"pool {p} work": sum(d_min[n, p] for n in names if where[n] == p) / sizes[p]
                 for p in range(len(sizes))}
        for a, b in CYCLES:
            if a in where and b in where:
                terms[f"{a} -> {b} cycle"] = t_min[a, where[a]] + t_min[b, where[b]]
        binding = max(terms, key=terms.get)
        out.append((terms[binding], split, binding))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", default=str(ROOT / "experiments/ppo_33b_a100_v100.py"))
    ap.add_argument("--alone", type=float, default=None, help="s/iteration of the best plan on pool 0 alone")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    graph = build_graph(load_experiment(args.experiment))
    cluster = graph.spec.cluster
    space = PlanSpace.build(graph, CostModel(graph))
    sizes = [p.n_devices for p in cluster.pools]
    rows = bounds(space, sizes)
    names = space.problem.call_names
    kinds = [p.device for p in cluster.pools]
    print(f"{'bound s/iter':>12}  {'max gain':>8}  {'binds':<28}" + "".join(f"{n:>14}" for n in names))
    for b, split, binding in rows[:args.top]:
        gain = f"{args.alone / b:.3f}x" if args.alone else "-"
        print(f"{b:>12.3f}  {gain:>8}  {binding:<28}" + "".join(f"{kinds[p]:>14}" for p in split))
    alone = next(b for b, split, _ in rows if not any(split))
    print(f"\nall calls on pool 0 ({kinds[0]}): bound {alone:.3f} s/iteration")


if __name__ == "__main__":
    main()
