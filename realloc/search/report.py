"""What ``realloc search`` prints and draws: plan tables, comparisons, the timeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from realloc import _C
from realloc.graph.plan import ExecutionPlan
from realloc.search.build import PlanSpace
from realloc.search.planner import SearchReport
from realloc.search.pool_space import pool_label

GiB = 2**30


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def plan_table(plan: ExecutionPlan, space: PlanSpace, indices: np.ndarray) -> str:
    """Per call: mesh, dp/tp/pp, micro-batches, activation recomputation, estimated seconds and peak GiB
    per device."""
    mem = space.cpp.memory(np.asarray(indices, np.int32))
    names = space.problem.call_names
    # Columns as wide as their longest entry plus two spaces, so long call or mesh names never run together.
    cw = max(len("call"), *map(len, names)) + 2
    mw = max(len("mesh"), *(len(plan.placements[n].mesh) for n in names)) + 2
    cluster = space.graph.spec.cluster
    # a cluster of pools: which pool (and device kind) each call runs on
    pools = [pool_label(cluster, space.options[c][int(indices[c])].mesh.pool) if cluster.pools else ""
             for c in range(len(names))]
    pw = max(map(len, pools)) + 2 if cluster.pools else 0
    header = (f"{'call':<{cw}}{'mesh':<{mw}}{'pool' if pw else '':<{pw}}{'devices':>8}{'dp':>4}{'tp':>4}{'pp':>4}{'mbs':>5}{'recomp':>8}"
              f"{'est. s':>10}{'peak GiB/dev':>14}")
    rows = [header, "-" * len(header)]
    for c, name in enumerate(names):
        p = plan.placements[name]
        rows.append(f"{name:<{cw}}{p.mesh:<{mw}}{pools[c]:<{pw}}{p.dp * p.tp * p.pp:>8}{p.dp:>4}{p.tp:>4}{p.pp:>4}{p.n_mbs:>5}"
                    f"{'yes' if p.recompute else '-':>8}{plan.call_times[name]:>10.3f}{_gib(mem['call_peak'][c]):>14}")
    offloaded = sorted(m for m, on in plan.offload.items() if on)
    if offloaded:
        rows.append(f"offloaded to host memory between calls (load time included above): {', '.join(offloaded)}")
    for a, b in plan.fused:  # docs/fused-training.md
        rows.append(f"fused: {a} + {b} (one pipeline schedule; {b}'s stages in reverse order; est. s above unfused)")
    return "\n".join(rows)


def transfer_summary(space: PlanSpace, indices: np.ndarray) -> list[str]:
    """Reallocation and data-transfer nodes of one steady-state iteration, from the schedule."""
    p = space.problem
    records = space.cpp.schedule(np.asarray(indices, np.int32))
    t = p.priced_window[1]  # the last priced iteration (its successors are simulated too)
    out = []
    realloc = [r for r in records if r[0] == _C.NODE_REALLOC and r[3] == t and r[5] > r[4]]
    for r in realloc:
        out.append(f"reallocate {p.model_names[p.call_model[r[1]]]} for {p.call_names[r[1]]}: "
                   f"{p.call_names[r[2]]} layout -> {p.call_names[r[1]]} layout, {r[5] - r[4]:.3f} s")
    data = [r for r in records if r[0] == _C.NODE_DATA and r[3] == t and r[5] > r[4]]
    if data:
        total = sum(r[5] - r[4] for r in data)
        out.append(f"data transfers: {len(data)} per iteration, {total:.3f} s in total "
                   f"(largest {max(r[5] - r[4] for r in data):.3f} s)")
    if not out:
        out.append("no reallocation or data transfer: every call uses its model's home layout and local data")
    return out


def comparison_table(report: SearchReport) -> str:
    ref = report.baselines.get("heuristic")
    ref_time = ref.plan.estimated_time if ref and ref.plan and ref.fits else None
    mem = report.spec.cluster.device_memory
    alone = f"pool {pool_label(report.spec.cluster, report.alone_pool)} alone" if report.alone is not None else ""
    w = max(len("searched"), len(alone), *map(len, report.baselines)) + 2
    fits_in = (f"fits in {_gib(mem)} GiB" if report.alone_pool is None else  # each pool's memory, each pool's plans
               "fits (" + ", ".join(f"{_gib(p.device_memory)} GiB on pool {i}"
                                    for i, p in enumerate(report.spec.cluster.pools)) + ")")
    header = f"{'plan':<{w}}{'s/iteration':>12}{'vs heuristic':>14}{'peak GiB/dev':>14}  {fits_in}"
    rows = [header, "-" * len(header)]
    if report.alone is not None:
        mem = report.alone.spec.cluster.device_memory  # the baselines and the pool alone run on that pool

    def row(name: str, plan: ExecutionPlan, fits: bool | None = None) -> str:
        speed = f"{ref_time / plan.estimated_time:.2f}x" if ref_time else "-"
        fits = plan.estimated_peak_memory <= mem if fits is None else fits
        return (f"{name:<{w}}{plan.estimated_time:>12.3f}{speed:>14}{_gib(plan.estimated_peak_memory):>14}  "
                f"{'yes' if fits else 'NO (out of memory)'}")

    rows.append(row("searched", report.plan, bool(report.evaluation["feasible"])))
    if report.fused is not None:  # the search's best fused plan lost to one without fusion (docs/fused-training.md)
        rows.append(row("fused", report.fused))
    elif report.unfused is not None:  # the searched plan fuses train calls
        rows.append(row("no fusion", report.unfused))
    if report.alone is not None:
        gain = report.alone.plan.estimated_time / report.plan.estimated_time
        speed = f"{ref_time / report.alone.plan.estimated_time:.2f}x" if ref_time else "-"
        rows.append(f"{alone:<{w}}{report.alone.plan.estimated_time:>12.3f}{speed:>14}"
                    f"{_gib(report.alone.plan.estimated_peak_memory):>14}  yes (searched on the strongest pool "
                    f"alone; the pools together: {gain:.3f}x as fast); the baselines below run on that pool")
    if report.alone_error is not None:  # the baselines run on that pool too: none fits either
        rows.append(f"pool {pool_label(report.spec.cluster, report.alone_pool)} alone: {report.alone_error}")
    for name, b in report.baselines.items():
        if report.alone_error is not None:
            continue
        rows.append(row(name, b.plan) if b.plan else f"{name:<{w}}{'n/a':>12}  ({b.error})")
    return "\n".join(rows)


def memory_summary(report: SearchReport) -> str:
    space, ev = report.space, report.evaluation
    cluster = report.spec.cluster
    peaks = np.asarray(space.cpp.memory(report.indices)["device_peak"])
    dev = int(ev["peak_device"])
    during = (f", while {space.problem.call_names[ev['peak_call']]} runs" if ev["peak_call"] >= 0 else "")
    cap = cluster.pool_cluster(cluster.pool_of_device(dev)).device_memory if cluster.pools else cluster.device_memory
    return (f"peak memory {_gib(ev['peak_memory'])} of {_gib(cap)} GiB "
            f"({100 * ev['peak_memory'] / cap:.0f}%) on device {dev} ({cluster.device_name(dev)})"
            f"{during}; over all devices min {_gib(peaks.min())}, mean {_gib(peaks.mean())} GiB")


def search_summary(report: SearchReport, n_threads: int) -> str:
    s = report.stats
    full = s.simulations / s.evals if s.evals else 1.0
    before = s.unsimulated / s.evals if s.evals else 0.0
    return (f"{s.evals:,} plans evaluated in {s.seconds:.1f} s ({s.evals_per_second:,.0f}/s on {n_threads} "
            f"thread(s); {full:.0%} simulated to the end, the rest stopped once proven rejected, {before:.0%} "
            f"before simulating); best found after {s.time_to_best:.2f} s ({s.evals_to_best:,} plans); "
            f"{s.priced_pairs} transfer costs priced by the estimator ({s.pricing_seconds:.2f} s)")


def candidate_summary(report: SearchReport) -> str:
    p = report.space.problem
    pruned_mem = sum(r.get("memory", 0) for r in report.space.pruned.values())
    pruned_dom = sum(r.get("dominated n_mbs", 0) for r in report.space.pruned.values())
    slow = sum(report.n_candidates_before_time_pruning) - sum(report.space.n_candidates)
    per_call = ", ".join(f"{n} {len(k)}" for n, k in zip(p.call_names, p.candidates))
    space = float(np.prod([len(k) for k in p.candidates], dtype=np.float64))
    return (f"candidates per call: {per_call} (plan space {space:.1e}); pruned {pruned_mem} that cannot fit, "
            f"{pruned_dom} dominated micro-batch counts, {slow} slower alone than the best baseline's iteration")


# -- timeline ------------------------------------------------------------------------------
def draw_timeline(space: PlanSpace, indices: np.ndarray, path: str | Path, title: str = "",
                  iterations: int = 3) -> Path:
    """The estimated timeline of the first ``iterations`` iterations (``realloc.search.timeline``)."""
    from realloc.search.timeline import estimated_panel, write_timeline

    plan = space.to_plan(indices, "search")
    return write_timeline([estimated_panel(space, indices, plan, iterations, title)], path)
