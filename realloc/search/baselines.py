"""Baseline plans, by name, to compare the searched plan with.

- ``heuristic``: REALHF-Heuristic (realhf.txt §8.1): every call on the whole cluster
  with the same strategy, no reallocation; TP inside a node (tp = the largest degree
  up to the node width that every model's heads allow), PP across nodes (pp = the
  smallest divisor of the node count whose plan fits in memory, so each stage is a
  run of whole nodes), DP over the rest; 4 micro-batches per call (at least pp, so
  the pipeline fills), more if that does not fit, and at a micro-batch count that
  does not fit otherwise, activation recomputation for the train steps (what a
  Megatron user turns on when memory is short). On 2 nodes x 8 this is
  realhf-appendix.txt Table 5: TP 8, PP 1, DP 2, 4 micro-batches.
- ``colocate-dp``: DeepSpeed-Chat (realhf.txt §8.1): every call on the whole cluster,
  data parallel for training and inference, and for generation its Hybrid Engine's
  TP inside a node with DP across nodes. realloc has no ZeRO-3, so training and
  inference are plain DP with replicated states: the closest layout in the plan
  space, which overstates the memory ZeRO-3 would need. Micro-batch counts are the
  best ones (the paper tunes baselines' options, §8.1).
- ``split``: OpenRLHF / HybridFlow "split" placement (hybridflow.txt §8.3): two
  disjoint device groups, one for the generating model and the models of its type
  (actor + reference), one for the rest (critic + reward), sized by parameter count
  (whole nodes; halves of a single node). Each call gets the best strategy and
  micro-batch count on its group's mesh (HybridFlow's auto-parallelism).

Baselines whose options leave a choice are solved exactly, by enumerating or
searching the restricted plan space with the same estimator.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from realloc.calls import InterfaceType
from realloc.cluster import DeviceMesh
from realloc.graph.dataflow import DataflowGraph
from realloc.search.build import PlanSpace
from realloc.search.candidates import MAX_N_MBS, Option, recompute_choices
from realloc.search.engine import run_mcmc
from realloc.strategy import ParallelStrategy, micro_batch_options, strategy_error

BASELINES = ("heuristic", "colocate-dp", "split")
HEURISTIC_N_MBS = 4  # realhf-appendix.txt Table 5
# Restricted spaces up to this many plans are enumerated; larger ones are searched.
ENUMERATE_LIMIT = 200_000
RESTRICTED_SEARCH_EVALS = 60_000

OptionFilter = Callable[[str, Option], bool]


def _node_tp(graph: DataflowGraph, width: int) -> int:
    """The largest tp <= width dividing it that every model with parameters allows."""
    cfgs = [cfg for c in graph.topo_order if (cfg := graph.model_config(c)) is not None]
    tp = width
    while tp > 1 and any(strategy_error(cfg, ParallelStrategy(1, tp, 1), width) for cfg in cfgs):
        tp //= 2
    return tp


def _pick_n_mbs(graph: DataflowGraph, call: str, dp: int, want: int) -> int | None:
    opts = [] if graph.dp_error(dp) else micro_batch_options(graph.steps_n_seqs(call), dp)
    if not opts:
        return None
    at_least = [m for m in opts if m >= want]
    return at_least[0] if at_least else opts[-1]


def _rule_strategy(graph: DataflowGraph, call: str, mesh: DeviceMesh) -> ParallelStrategy | None:
    """A parameter-free call runs pure data parallel."""
    ok = graph.steps_n_seqs(call) % mesh.size == 0 and not graph.dp_error(mesh.size)
    return ParallelStrategy(mesh.size, 1, 1) if ok else None


def heuristic_plans(graph: DataflowGraph) -> list[dict[str, Option]]:
    """The heuristic's plans in the order it tries them: fewest pipeline stages first, then
    the fewest micro-batches (from 4, at least pp), then without and with recomputation in the
    train steps; the first that fits in memory is the heuristic."""
    cluster = graph.spec.cluster
    whole = cluster.whole
    tp = _node_tp(graph, cluster.n_devices_per_node)
    out = []
    for pp in [d for d in range(1, cluster.n_nodes + 1) if cluster.n_nodes % d == 0]:
        dp = cluster.n_devices // (tp * pp)
        seen: set[tuple] = set()
        want = max(HEURISTIC_N_MBS, pp)
        while want <= MAX_N_MBS:
            chosen: dict[str, Option] = {}
            for c in graph.topo_order:
                cfg = graph.model_config(c)
                s = _rule_strategy(graph, c, whole) if cfg is None else ParallelStrategy(dp, tp, pp)
                if s is None or (cfg is not None and strategy_error(cfg, s, whole.n_devs)):
                    break
                m = _pick_n_mbs(graph, c, s.dp, want)
                if m is None:
                    break
                chosen[c] = Option(whole, s, m)
            else:
                key = tuple(sorted((c, o.n_mbs) for c, o in chosen.items()))
                if key not in seen:
                    seen.add(key)
                    out.append(chosen)
                    trains = {c for c in chosen if True in recompute_choices(graph, c)}
                    if trains:
                        out.append({c: o._replace(recompute=c in trains) for c, o in chosen.items()})
            want *= 2
    return out


def colocate_filter(graph: DataflowGraph) -> OptionFilter:
    cluster = graph.spec.cluster
    whole = cluster.whole
    tp = _node_tp(graph, cluster.n_devices_per_node)

    def keep(call: str, opt: Option) -> bool:
        mesh, s = opt.mesh, opt.strategy
        if mesh != whole:
            return False
        if graph.model_config(call) is None or graph.call(call).interface_type is not InterfaceType.GENERATE:
            return s == ParallelStrategy(cluster.n_devices, 1, 1)
        return s == ParallelStrategy(cluster.n_nodes, tp, 1)
    return keep


def split_groups(graph: DataflowGraph) -> tuple[frozenset[str], frozenset[str]]:
    """Models of the generation side (generating models and models of their type) and the rest."""
    gen_models = {graph.call(c).model_name for c in graph.topo_order
                  if graph.call(c).interface_type is InterfaceType.GENERATE}
    gen_types = {graph.model_types[m] for m in gen_models}
    a = frozenset(m for m in graph.model_types if m in gen_models or graph.model_types[m] in gen_types)
    b = frozenset(graph.model_types) - a
    if not a or not b:
        raise ValueError("the split baseline needs a generating model and at least one model of another type "
                         f"(models: {', '.join(graph.model_types)})")
    return a, b


def split_meshes(graph: DataflowGraph) -> tuple[DeviceMesh, DeviceMesh]:
    cluster = graph.spec.cluster
    a, b = split_groups(graph)

    def params(models: frozenset[str]) -> int:
        total = 0
        for m in models:
            cfg = graph.model_config(graph.calls_of_model(m)[0])
            total += 0 if cfg is None else cfg.total_params
        return total

    pa, pb = params(a), params(b)
    n, width = cluster.n_nodes, cluster.n_devices_per_node
    if n >= 2:
        na = min(n - 1, max(1, round(n * pa / max(1, pa + pb))))
        return DeviceMesh(cluster.nodes[:na], 0, 0, width, width), DeviceMesh(cluster.nodes[na:], na, 0, width, width)
    if width < 2:
        raise ValueError(f"the split baseline needs at least 2 devices; cluster {cluster.nodelist!r} has 1")
    half = width // 2
    node = cluster.nodes[0]
    return DeviceMesh((node,), 0, 0, half, width), DeviceMesh((node,), 0, half, half, width)


def split_filter(graph: DataflowGraph) -> OptionFilter:
    a, _ = split_groups(graph)
    mesh_a, mesh_b = split_meshes(graph)

    def keep(call: str, opt: Option) -> bool:
        return opt[0] == (mesh_a if graph.call(call).model_name in a else mesh_b)
    return keep


def best_in(space: PlanSpace, seed: int = 0) -> np.ndarray:
    """The best plan of a (small) restricted space: enumerated when small enough, else searched."""
    sizes = space.n_candidates
    if int(np.prod(sizes, dtype=np.float64)) <= ENUMERATE_LIMIT:
        plans = np.array(list(itertools.product(*[range(n) for n in sizes])), np.int32).reshape(-1, len(sizes))
        space.price_all_pairs()
        plans = np.c_[plans, np.zeros((len(plans), len(space.problem.fused)), np.int32)]  # baselines fuse nothing
        res = space.cpp.evaluate_batch(plans)
        order = np.lexsort((res["cost"], ~res["feasible"]))
        return plans[order[0]]
    out = run_mcmc(space, time_limit=None, max_evals=RESTRICTED_SEARCH_EVALS, seed=seed, n_chains=2, n_threads=2)
    return out.indices
