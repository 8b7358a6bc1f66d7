"""``realloc show``: validate an experiment as a run would, and print its graph and the plan space."""

from __future__ import annotations

import argparse

from realloc.api import ExperimentSpec
from realloc.graph.dataflow import DataflowGraph, build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.streaming import check_runtime_tail, split_consumers
from realloc.models.families import describe_shape
from realloc.overrides import load_with_overrides
from realloc.runtime.inputs.preflight import preflight
from realloc.runtime.inputs.run_config import RunConfig
from realloc.search.candidates import call_options
from realloc.search.turns_report import profile_lines


def main(args: argparse.Namespace) -> int:
    spec = load_with_overrides(args.experiment, getattr(args, "set", None) or ())
    graph = build_graph(spec)
    cluster = spec.cluster
    print(f"experiment {spec.name}  ({spec.source})")
    print(f"cluster    {cluster.describe()}")
    print(f"workload   batch {spec.describe_batch()}, prompt {spec.prompt_len} + generation {spec.gen_len} tokens")
    print(f"graph      {len(spec.rpcs)} calls, {graph.graph.number_of_edges()} edges, digest {graph.digest}")
    for model, src in spec.models.items():
        cfg = graph.model_configs.get(model)
        shape = f": {describe_shape(cfg)}" if cfg is not None else ""
        print(f"checkpoint {model}: {src.path}{' (new value head)' if src.new_value_head else ''}{shape}")
    for line in _preflight(spec, graph) + graph.warnings():
        print(line)
    for line in profile_lines(graph):  # multi-turn rollouts: the turns the planner prices
        print(line)
    plan_path = getattr(args, "plan", None)
    if plan_path:
        plan = ExecutionPlan.load(plan_path)
        meshes = validate_plan(plan, graph)  # a mesh across pools, a mistyped node or strategy: one error
        check_runtime_tail(plan, graph)  # a tail entry the runtime cannot carry out (pp > 1): the run's one error
        print(f"plan       {plan_path}: valid{plan.edited_note()}"
              + (f"; pools: {', '.join(f'{c} on pool {m.pool}' for c, m in meshes.items())}" if cluster.pools else ""))
        for g, t in plan.tail.items() if cluster.pools else ():  # streaming across pools: where each part goes
            if t.streams_only:
                to = ", ".join(f"{c} on pool {meshes[c].pool}" for c in split_consumers(plan, graph, g))
                print(f"stream     {g} on pool {meshes[g].pool} hands its "
                      f"{'micro-batches' if t.micro_batches else 'finished rows'} on to: {to or 'no consumer'}")
        for g, t in () if cluster.pools else plan.tail.items():  # one pool: say so only when nothing streams
            if t.streams_only and not split_consumers(plan, graph, g):
                print(f"stream     {g} hands its rows to no call: every call that reads them shares its devices "
                      f"or reads a key of another call, so it runs as without the entry (in more requests); place "
                      f"a consumer off {g}'s mesh or drop the entry (realloc search drops such an entry)")
    print()
    print(graph.describe())
    print()
    meshes = cluster.device_meshes()
    print(f"{len(meshes)} device meshes; candidate placements (mesh x strategy x micro-batches, x recomputation "
          f"for train steps) per call:")
    total = 1
    w = max(len("plan space"), *map(len, graph.topo_order)) + 2
    for name in graph.topo_order:
        n = len(call_options(graph, name))
        total *= max(n, 1)
        print(f"  {name:<{w}}{n:>8}")
    print(f"  {'plan space':<{w}}{total:>8.2e}")
    return 0


def _preflight(spec: ExperimentSpec, graph: DataflowGraph) -> tuple[str, ...]:
    """Weights, tokenizer and prompts checked as a run would, and the user's rewards called on the first prompt
    (errors here, before anything starts)."""
    return preflight(spec, RunConfig.of(spec, require_dataset=False), graph, probe_rewards=True).lines
