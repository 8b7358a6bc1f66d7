"""``realloc search EXP [--search-time S | --evals N] [--seed N] [--out plan.json] [--timeline plan.svg]``.

Plans only; ``realloc run`` launches workers. Prints the cluster, the searched plan
per call, its estimated time per iteration next to every baseline, peak memory
against device memory, and search statistics. Without ``--search-time`` or ``--evals`` it searches until the best
plan stops improving (``engine.converged``), at most ``DEFAULT_TIME`` seconds, as ``realloc run`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from realloc.lengths import lengths_from_run
from realloc.search.engine import MAX_THREADS, converged
from realloc.overrides import load_with_overrides
from realloc.search.fused_report import fused_summary
from realloc.search.lora_report import lora_summary
from realloc.search.planner import SearchReport, baseline, experiment_of, plan_search
from realloc.search.tail_report import tail_summary
from realloc.search.timeline import check_suffix
from realloc.search.turns_report import profile_lines, turn_summary, turns_from

DEFAULT_TIME = 10.0  # seconds of search at most when the user gives neither a time nor a budget


def _progress(enabled: bool, time_limit: float | None, max_evals: int | None):
    """A rich progress bar on stderr, or None when stderr is not a terminal."""
    if not enabled or not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=True)
    total = float(max_evals) if time_limit is None else float(time_limit)
    task = bar.add_task("search", total=total, info="")

    def update(seconds: float, evals: int, best: dict) -> None:
        done = float(evals) if time_limit is None else seconds
        best_s = f"best {best['time']:.3f} s/iter" if best["feasible"] else "no plan fits yet"
        bar.update(task, completed=min(done, total), info=f"{evals:,} plans, {best_s}")

    return bar, update


def print_report(report: SearchReport, n_threads: int) -> None:
    from realloc.search import report as rp

    spec, cluster = report.spec, report.spec.cluster
    print(f"experiment {spec.name}  ({spec.source})")
    print(f"cluster    {cluster.describe()}")
    print(f"workload   batch {spec.describe_batch()}, prompt {spec.prompt_len} + generation {spec.gen_len} tokens, "
          f"{len(spec.rpcs)} calls; estimator: {_estimator_source(report)}")
    if not spec.response_lengths.is_fixed:
        print(f"           response lengths {spec.response_lengths.describe(spec.gen_len)}")
    for line in profile_lines(report.graph):
        print(line)
    print(f"           {rp.candidate_summary(report)}")
    print()
    print("searched plan")
    print(rp.plan_table(report.plan, report.space, report.indices))
    for line in rp.transfer_summary(report.space, report.indices):
        print(f"  {line}")
    for line in tail_summary(report):
        print(line)
    if report.by_staleness:
        print()
        print(staleness_table(report))
        sync = report.sync_plan
        if report.plan.staleness and sync is not None:
            print()
            print("best synchronous plan (staleness 0)")
            print(sync.table(report.graph.topo_order))
    if report.alone is not None:
        print()
        print(f"best plan on the strongest pool alone (pool {report.alone_pool}: "
              f"{cluster.pool_cluster(report.alone_pool).device})")
        print(report.alone.plan.table(report.graph.topo_order))
    if report.fused is not None:
        print()
        print("best fused plan found (slower than the searched plan, which fuses nothing)")
        print(report.fused.table(report.graph.topo_order))
    elif report.unfused is not None:
        print()
        print("best plan without fusion")
        print(report.unfused.table(report.graph.topo_order))
    print()
    print("estimated time per iteration (steady state)")
    print(rp.comparison_table(report))
    print()
    print(rp.memory_summary(report))
    tight = report.plan.memory_warning(report.spec.cluster.device_memory)
    if tight:
        print(tight)
    for line in lora_summary(report.graph, report.space.cost, report.plan):
        print(line)
    for line in fused_summary(report.graph, report.space.cost, report.fused or report.plan,
                              (report.fused or report.plan).estimated_time, report.unfused):
        print(line)
    for line in turn_summary(report.graph, report.space.cost, report.plan):
        print(line)
    print(f"search: {rp.search_summary(report, n_threads)}")


def staleness_table(report: SearchReport) -> str:
    """The best plan found at each staleness (asynchronous RL), its estimate and speed-up over synchronous."""
    plans = report.by_staleness
    base = plans[0].estimated_time
    rows = [f"staleness (generation runs up to eta train steps ahead; max_staleness={report.spec.max_staleness})",
            f"{'eta':>5}{'est. s/iter':>14}{'vs eta=0':>10}"]
    for eta, plan in sorted(plans.items()):
        mark = "  <- chosen" if eta == report.plan.staleness else ""
        rows.append(f"{eta:>5}{plan.estimated_time:>14.3f}{base / plan.estimated_time:>9.2f}x{mark}")
    return "\n".join(rows)


def _estimator_source(report: SearchReport) -> str:
    cost = report.space.cost
    models = cost.pool_models or (cost,)  # a cluster of pools: each pool's own profiles or roofline
    sources = sorted({m.layer_costs(cfg).source for m in models for c in report.graph.topo_order
                      if (cfg := report.graph.model_config(c)) is not None})
    return ", ".join(sources) or "no models"


def _dry_run_note(args: argparse.Namespace) -> None:
    """After a search that went well (an error stays one line): the old --dry-run flag did nothing."""
    if getattr(args, "dry_run", False):
        print("realloc search: note: --dry-run changes nothing (search only plans; `realloc run` launches workers)",
              file=sys.stderr)


def convergence_line(report: SearchReport, time_limit: float) -> str:
    """What a search without a given time did: stopped once converged (after how long), or ran to the limit."""
    s = report.stats
    if converged(s.evals, s.evals_to_best):
        return (f"search: converged after {s.seconds:.1f} s (the best plan, found after {s.evals_to_best:,} plans, "
                f"stood for {s.evals - s.evals_to_best:,} more; --search-time S searches S seconds)")
    return (f"search: still improving at the limit of {time_limit:g} s (the best plan found after "
            f"{s.evals_to_best:,} of {s.evals:,} plans); --search-time S searches longer")


def main(args: argparse.Namespace) -> int:
    max_evals = getattr(args, "evals", None)
    converge = args.time is None and not max_evals  # no time, no budget: until the best plan stops improving
    time_limit = args.time if args.time is not None else (None if max_evals else DEFAULT_TIME)
    if time_limit is not None and not 0 < time_limit < math.inf:
        raise ValueError(f"--search-time must be a positive, finite number of seconds, got {args.time:g}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be from 0 to 2**63 - 1, got {args.seed}")
    if max_evals is not None and max_evals < 1:
        raise ValueError(f"--evals must be positive, got {max_evals}")
    n_threads = getattr(args, "threads", 2)
    if not 1 <= n_threads <= MAX_THREADS:
        raise ValueError(f"--threads must be from 1 to {MAX_THREADS} (one MCMC chain each), got {n_threads}")
    if args.timeline:
        check_suffix(args.timeline)
    for option, path in (("--out", args.out), ("--timeline", args.timeline)):
        # before the search: a wrong folder must not cost the search's time first
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{option} {path}: folder {Path(path).resolve().parent} does not exist; create it first")
        if path and Path(path).is_dir():
            raise ValueError(f"{option} {path} is a folder; give a file name in it")
    experiment = load_with_overrides(args.experiment, getattr(args, "set", None) or ())
    if getattr(args, "lengths_from", None):
        lengths = lengths_from_run(args.lengths_from, experiment.gen_len)
        lengths.check(experiment.gen_len)
        experiment = turns_from(dataclasses.replace(experiment, response_lengths=lengths), args.lengths_from)
    name = getattr(args, "baseline", None)
    if name:
        spec = experiment_of(experiment)
        plan = baseline(spec, name)
        print(f"experiment {spec.name}  ({spec.source})")
        print(f"cluster    {spec.cluster.describe()}")
        print(f"workload   batch {spec.describe_batch()}, prompt {spec.prompt_len} + generation {spec.gen_len} tokens")
        print(f"baseline   {name}")
        print(plan.table())
        mem = spec.cluster.device_memory
        print(f"peak memory {plan.estimated_peak_memory / 2**30:.2f} of {mem / 2**30:.2f} GiB"
              f"{'' if plan.estimated_peak_memory <= mem else '  -- DOES NOT FIT'}")
        if args.out:
            plan.save(args.out)
            print(f"wrote {args.out}")
        _dry_run_note(args)
        return 0
    bar, update = _progress(True, time_limit, max_evals)
    if bar is not None:
        with bar:
            report = plan_search(experiment, time_limit, seed=args.seed, max_evals=max_evals,
                                 n_threads=n_threads, progress=update, converge=converge)
    else:
        report = plan_search(experiment, time_limit, seed=args.seed, max_evals=max_evals, n_threads=n_threads,
                             converge=converge)
    print_report(report, n_threads)
    if converge:
        print(convergence_line(report, DEFAULT_TIME))
    if args.out:
        report.plan.save(args.out)
        print(f"wrote plan {args.out}")
    if args.timeline:
        from realloc.search.report import draw_timeline

        draw_timeline(report.space, report.indices, args.timeline)
        print(f"wrote timeline {args.timeline}")
    _dry_run_note(args)
    return 0
