"""Multi-turn rollouts in the planner's output (issue 34, item 4): the turn profile a search prices, each turn's
estimated time in the plan, the turns on the estimated timeline, and ``--lengths-from`` for multi-turn runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from realloc.envs.rollout_args import is_multiturn, rollout_args, rollout_shape
from realloc.envs.turn_profile import has_turns, turns_from_run, with_profile
from realloc.graph.dataflow import DataflowGraph, build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan


def turns_from(spec: Any, run_dir: str | Path) -> Any:
    """``spec`` with its multi-turn GENERATE calls priced on the turns an earlier run logged (when it logged any),
    with the tool processes that ran at once on a host in that run (its ``plan.json``; the estimator prices other
    plans' contention from it, ``multiturn_cost.tool_slowdown``)."""
    graph = build_graph(spec)
    calls = [c for c in graph.topo_order if is_multiturn(graph.interfaces.get(c))]
    if not calls or not has_turns(run_dir):
        return spec
    profile = turns_from_run(run_dir)
    for c in calls:  # a run of more turns than this experiment allows (it names --lengths-from, not turn_profile)
        cap = rollout_args(c, graph.call(c).interface_args).max_turns
        if profile.turns > cap:
            raise ValueError(f"--lengths-from {run_dir}: its rollouts took up to {profile.turns} turns, but call "
                             f"{c!r} allows max_turns={cap}; take the lengths from a run of this experiment or "
                             f"leave --lengths-from out")
    at_once = _tool_processes(graph, calls[0], Path(run_dir) / "plan.json")
    return with_profile(spec, calls, dataclasses.replace(profile, tool_processes=at_once))


def _tool_processes(graph: DataflowGraph, call: str, plan_path: Path) -> float | None:
    """Tool processes at once on one host under the run's plan: the call's replicas on a host x min(env_workers,
    rollouts per replica), as ``CostModel.tool_host`` counts them; None (unknown: no contention priced) when the
    run left no plan of that call."""
    from realloc.estimator.cost import CostModel

    try:
        plan = ExecutionPlan.load(plan_path)
        p = plan.placements[call]
    except (OSError, ValueError, KeyError):
        return None
    shape = rollout_shape(call, graph.interfaces.get(call), graph.call(call).interface_args, graph.spec.gen_len)
    assert shape is not None
    mesh = graph.spec.cluster.mesh(p.mesh)
    host = CostModel.tool_host_of(graph.spec.cluster, mesh, p.strategy)
    rows = -(-graph.spec.n_seqs(graph.call(call)) // p.strategy.dp)
    return float(host.replicas * min(shape.env_workers, rows))


def profile_lines(graph: DataflowGraph) -> list[str]:
    """One line per multi-turn GENERATE call: the turn profile its estimate uses."""
    out = []
    for c in graph.topo_order:
        rpc = graph.call(c)
        shape = rollout_shape(c, graph.interfaces.get(c), rpc.interface_args, graph.spec.gen_len)
        if shape is not None:
            out.append(f"turns      {c}: {shape.profile.describe(shape.turn_tokens)}; at most {shape.turn_tokens} "
                       f"tokens a turn, {shape.env_workers} environment threads")
    return out


def turn_summary(graph: DataflowGraph, cost: Any, plan: ExecutionPlan) -> list[str]:
    """Each multi-turn call's turns as the plan's estimate prices them, on one dp rank."""
    out = []
    calls = [c for c in graph.topo_order if cost.rollout_shape(c) is not None and c in plan.placements]
    meshes = validate_plan(plan, graph) if calls else {}
    for c in calls:
        p = plan.placements[c]
        turns = cost.turns(c, meshes[c], p.strategy, p.n_mbs)
        parts = [f"turn {t.turn}: {t.rows} rollouts, prompt {t.prompt} + {t.tokens} tokens, generation "
                 f"{t.generate.time:.3f} s, environment {t.env_s:.3f} s" for t in turns]
        out.append(f"{c} per dp rank: " + "; ".join(parts))
    return out


def turn_boxes(cost: Any, plan: ExecutionPlan, boxes: Sequence[Any]) -> list[Any]:
    """For each call box of a multi-turn call on the estimated timeline, a box per turn's environment steps
    (kind ``tools``) inside it, in proportion: the generation of each turn is what stays in the call's colour."""
    out, meshes = [], None
    for b in boxes:
        if b.kind != "call" or b.label not in plan.placements or cost.rollout_shape(b.label) is None:
            continue
        p = plan.placements[b.label]
        meshes = meshes or validate_plan(plan, cost.graph)
        mesh = meshes[b.label]
        turns = cost.turns(b.label, mesh, p.strategy, p.n_mbs)
        total = cost.call_cost(b.label, mesh, p.strategy, p.n_mbs).time
        scale = (b.end - b.start) / total if total > 0 else 0.0
        t = b.start + scale * (total - sum(x.time for x in turns))  # the call's own overhead first
        for x in turns:
            t += scale * x.generate.time
            if x.env_s > 0:
                out.append(dataclasses.replace(b, kind="tools", label=f"{b.label} turn {x.turn}: environment",
                                               start=t, end=t + scale * x.env_s, detail=""))
            t += scale * x.env_s
    return out



def measured_turn_boxes(plan: ExecutionPlan, boxes: Sequence[Any], metrics: Sequence[dict]) -> list[Any]:
    """The measured timeline's counterpart of ``turn_boxes``: in each box of a multi-turn call, a box per turn's
    environment time, from the call's ``turn<k>_generate_s`` / ``turn<k>_env_s`` in the iteration's metrics (summed
    over the dp replicas' environment ranks, so divided by dp: a replica's mean), from the box's start."""
    calls = {m["iteration"]: m.get("calls") or {} for m in metrics if isinstance(m, dict) and "iteration" in m}
    out = []
    for b in boxes:
        stats = calls.get(b.iteration, {}).get(b.label, {}) if b.kind == "call" else {}
        turns = sorted(int(k[4:-len("_generate_s")]) for k in stats
                       if k.startswith("turn") and k.endswith("_generate_s") and k[4:-len("_generate_s")].isdigit())
        if not turns or b.label not in plan.placements:
            continue
        dp = plan.placements[b.label].dp
        parts = [(stats[f"turn{k}_generate_s"] / dp, stats.get(f"turn{k}_env_s", 0.0) / dp) for k in turns]
        total = sum(g + e for g, e in parts)
        scale = min(1.0, (b.end - b.start) / total) if total > 0 else 0.0  # never past the box
        t = b.start
        for k, (g, e) in zip(turns, parts):
            t += scale * g
            if e > 0:
                out.append(dataclasses.replace(b, kind="tools", label=f"{b.label} turn {k}: environment", start=t,
                                               end=t + scale * e, detail=""))
            t += scale * e
    return out
