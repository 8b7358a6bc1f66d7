"""The planning entry points: ``search(experiment)`` and ``baseline(experiment, name)``.

    from realloc.search import search, baseline
    plan = search("experiments/ppo_7b_7b.py", time_limit=10)      # an ExecutionPlan
    ref = baseline("experiments/ppo_7b_7b.py", "heuristic")
    print(plan.estimated_time, ref.estimated_time)

``experiment`` is an ExperimentSpec, an experiment file or module (``load_experiment``
syntax), or an ``@auto`` class or instance. ``plan_search`` returns the full report
(baselines, search statistics, the plan space) that ``realloc search`` prints.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from realloc.api import AUTO_ATTR, ExperimentSpec, experiment_spec, load_experiment
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import DataflowGraph, build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan
from realloc.search import baselines as bl
from realloc.search.build import NoFitError, PlanSpace, fmt_bytes
from realloc.search.engine import Progress, SearchStats, run_mcmc
from realloc.search.pool_space import on_cluster, pool_alone, strongest_pool
from realloc.search.tail_space import drop_idle_streams, untailed_indices, without_tails


def experiment_of(experiment: Any) -> ExperimentSpec:
    if isinstance(experiment, ExperimentSpec):
        return experiment
    if isinstance(experiment, str):
        return load_experiment(experiment)
    cls = experiment if isinstance(experiment, type) else type(experiment)
    if hasattr(cls, AUTO_ATTR):
        return experiment_spec(experiment)
    raise ValueError(f"cannot plan {experiment!r}: give an ExperimentSpec, an experiment file (path/exp.py[:Class]) "
                     f"or an @auto experiment class")


@dataclasses.dataclass(frozen=True)
class BaselineResult:
    name: str
    plan: ExecutionPlan | None
    error: str | None = None  # why the baseline does not apply
    device_memory: int = 0

    @property
    def fits(self) -> bool:
        return self.plan is not None and (self.plan.estimated_peak_memory or 0) <= self.device_memory


def _baseline(graph: DataflowGraph, cost: CostModel, name: str, seed: int = 0) -> ExecutionPlan:
    source = f"baseline:{name}"
    if name == "heuristic":
        tries = bl.heuristic_plans(graph)
        if not tries:
            raise ValueError("the heuristic plan does not apply: no (dp, tp, pp) with tp inside a node and pp across "
                             "nodes divides every call's batch")
        mem = graph.spec.cluster.device_memory
        # fewest stages, then fewest micro-batches, that fit; else the first (reported as OOM)
        chosen = next((t for t in tries if max(cost.plan_memory(_uniform_plan(graph, t)).values()) <= mem), tries[0])
        space = PlanSpace.build(graph, cost, option_filter=lambda c, o: o == chosen[c], prune_memory=False,
                                offload=False, migrate=False)
        return space.to_plan(space.fastest(), source)
    if name == "colocate-dp":
        keep = bl.colocate_filter(graph)
    elif name == "split":
        keep = bl.split_filter(graph)
    else:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(bl.BASELINES)}")
    try:
        space = PlanSpace.build(graph, cost, option_filter=keep, prune_memory=True, offload=False, migrate=False)
    except NoFitError:
        space = PlanSpace.build(graph, cost, option_filter=keep, prune_memory=False, offload=False, migrate=False)
    return space.to_plan(bl.best_in(space, seed), source)


def _uniform_plan(graph: DataflowGraph, options: dict) -> ExecutionPlan:
    cluster = graph.spec.cluster
    return ExecutionPlan(experiment=graph.spec.name, graph_digest=graph.digest, nodelist=cluster.nodelist,
                         n_devices_per_node=cluster.n_devices_per_node, device=cluster.device,
                         placements={c: CallPlacement.of(*o) for c, o in options.items()})


def baseline(experiment: Any, name: str, cost: CostModel | None = None) -> ExecutionPlan:
    """A baseline plan by name (``realloc.search.baselines``), with the estimator's numbers filled in."""
    spec = experiment_of(experiment)
    graph = build_graph(spec)
    if spec.cluster.pools:  # a baseline places calls on one kind of device: the strongest pool's
        alone = build_graph(pool_alone(spec, strongest_pool(spec.cluster)))
        return on_cluster(_baseline(alone, CostModel(alone), name), graph)
    return _baseline(graph, cost or CostModel(graph), name)


@dataclasses.dataclass(frozen=True)
class SearchReport:
    spec: ExperimentSpec
    graph: DataflowGraph
    space: PlanSpace
    plan: ExecutionPlan
    indices: np.ndarray
    evaluation: dict
    baselines: dict[str, BaselineResult]
    stats: SearchStats
    prepare_seconds: float
    n_candidates_before_time_pruning: tuple[int, ...]
    # Asynchronous RL (max_staleness > 0): the best plan found at each staleness, 0 (synchronous) first.
    by_staleness: dict[int, ExecutionPlan] = dataclasses.field(default_factory=dict)
    # A cluster of pools: the search on the strongest pool alone (its plan also starts this search's chains).
    alone: "SearchReport | None" = None
    alone_pool: int | None = None
    # When the search's best plan fuses train pairs (docs/fused-training.md): the best plan found without fusion
    # (the searched plan when faster, and then ``fused`` is the fused one).
    unfused: ExecutionPlan | None = None
    fused: ExecutionPlan | None = None
    # Long-tail migration (search/tail_space.py): the best plan without any migration, when the space had one.
    no_tail: ExecutionPlan | None = None
    # A cluster of pools whose strongest pool alone holds no plan (the pools together may: a larger batch, more
    # models): why, and ``alone`` is None.
    alone_error: str | None = None

    @property
    def sync_plan(self) -> ExecutionPlan | None:
        """The best synchronous plan, when the search also tried running generation ahead."""
        return self.by_staleness.get(0)

    def baseline_indices(self, name: str) -> np.ndarray | None:
        b = self.baselines.get(name)
        return None if b is None or b.plan is None else self.space.indices_of(b.plan)


def plan_search(experiment: Any, time_limit: float | None = 10.0, *, seed: int = 0, max_evals: int | None = None,
                n_threads: int = 2, n_chains: int | None = None, progress: Progress | None = None,
                cost: CostModel | None = None, converge: bool = False, runnable: RunLimits | None = None,
                max_n_mbs: int | None = None, offload: bool = True) -> SearchReport:
    """Search the fastest plan of ``experiment`` and compare it with every baseline; with ``converge``, stop
    before ``time_limit`` once the best plan stops improving (``engine.converged``). ``runnable`` (what
    ``realloc run`` passes): only plans its runtime can carry out, see ``RunLimits``. ``max_n_mbs``: at most this
    many micro-batches per call (1: every call takes its batch at once, as DeepSpeed-Chat does without gradient
    accumulation; ``benchmarks/bench_batch_rule.py``); baselines with more are shown but start no chain.
    ``offload=False``: frozen models stay on their devices between calls (``PlanSpace.build``), as in DeepSpeed-Chat."""
    if max_n_mbs is not None and (not isinstance(max_n_mbs, int) or isinstance(max_n_mbs, bool) or max_n_mbs < 1):
        raise ValueError(f"plan_search: max_n_mbs must be a positive integer (micro-batches per call) or None (no "
                         f"limit), got {max_n_mbs!r}")
    if not isinstance(offload, bool):
        raise ValueError(f"plan_search: offload must be True or False, got {offload!r}")
    t0 = time.perf_counter()
    spec = experiment_of(experiment)
    graph = build_graph(spec)
    fuse = runnable is None or runnable.fused_pairs
    cost = cost or CostModel(graph)
    mem = spec.cluster.device_memory
    alone, alone_pool, alone_error = None, None, None
    if spec.cluster.pools:
        # The strongest pool alone first (a third of the time): the plan to beat, and a start of the chains.
        alone_pool = strongest_pool(spec.cluster)
        try:
            alone = plan_search(pool_alone(spec, alone_pool), None if time_limit is None else time_limit / 3,
                                seed=seed, max_evals=max_evals, n_threads=n_threads, n_chains=n_chains,
                                converge=converge, max_n_mbs=max_n_mbs, offload=offload)
        except NoFitError as e:  # the pools together may hold what the strongest alone cannot
            alone_error = f"no plan fits pool {alone_pool} alone: {e}"
        time_limit = None if time_limit is None else time_limit * 2 / 3
    results: dict[str, BaselineResult] = {}
    for name in bl.BASELINES:
        if alone_error is not None:
            results[name] = BaselineResult(name, None, alone_error)
            continue
        if alone is not None:  # the baselines place calls on one cluster of one kind: the strongest pool's
            b = alone.baselines[name]
            results[name] = dataclasses.replace(b, plan=b.plan and on_cluster(b.plan, graph))
            continue
        try:
            results[name] = BaselineResult(name, _baseline(graph, cost, name, seed), device_memory=mem)
        except ValueError as e:  # the baseline does not apply to this experiment
            results[name] = BaselineResult(name, None, str(e), device_memory=mem)
    fitting = [r.plan for r in results.values() if r.fits and (offload or not any(r.plan.offload.values()))
               and (max_n_mbs is None or all(p.n_mbs <= max_n_mbs for p in r.plan.placements.values()))]
    if alone is not None:
        fitting.append(on_cluster(alone.plan, graph))
    full = PlanSpace.build(graph, cost, keep=fitting, max_n_mbs=max_n_mbs, offload=offload)
    before = full.n_candidates
    # A call slower alone than a feasible baseline's whole iteration can be in no plan that
    # beats it (in steady state each call runs once per iteration on its mesh).
    starts = [full.indices_of(p) for p in fitting]
    space = full
    if fitting:
        t_ref = min(p.estimated_time for p in fitting)
        rows = []
        for c, k in enumerate(full.problem.candidates):
            must = {int(s[c]) for s in starts}
            t_alone = full.total_times(c)
            rows.append([i for i in range(len(k)) if t_alone[i] <= t_ref or i in must])
        space = full.restrict(rows)
        starts = [space.indices_of(p) for p in fitting]
    prepare = time.perf_counter() - t0
    no_tail = None
    if space.tails:
        # The best plan without migration first (a third of the time): shown beside the winner, and a start of its
        # chains, so the winner is never slower.
        no_tail_space, no_tail_starts = without_tails(space, starts)
        third = None if time_limit is None else time_limit / 3
        found = run_mcmc(no_tail_space, time_limit=third, max_evals=None if max_evals is None else max(1, max_evals // 3),
                         seed=seed, n_threads=n_threads, n_chains=n_chains or n_threads, starts=no_tail_starts,
                         progress=progress, converge=converge, **({} if fuse else {"p_fuse": 0.0}))
        no_tail = no_tail_space.to_plan(found.indices, "search")
        starts = starts + [space.indices_of(no_tail)]
        time_limit = None if time_limit is None else time_limit - third
        max_evals = None if max_evals is None else max(1, max_evals - max_evals // 3)
    # Bounded staleness is one more plan dimension (issue 25): the placement is searched at every staleness
    # up to the experiment's bound, each with its share of the time, and the fastest plan wins.
    etas = [0] + ([e for e in range(1, spec.max_staleness + 1) if graph.staleness_error(e) is None]
                  if spec.max_staleness else [])
    share = None if time_limit is None else time_limit / len(etas)
    evals = None if max_evals is None else max(1, max_evals // len(etas))
    best = None
    by_staleness: dict[int, ExecutionPlan] = {}
    for eta in etas:
        sp = space.with_staleness(eta)
        # the synchronous winner starts the chains of the others: its placement is a good one at any eta
        extra = [best[1].indices] if best is not None else []
        outcome = run_mcmc(sp, time_limit=share, max_evals=evals, seed=seed, n_threads=n_threads,
                           n_chains=n_chains or n_threads, starts=starts + extra, progress=progress,
                           converge=converge, **({} if fuse else {"p_fuse": 0.0}))
        if len(etas) > 1:
            by_staleness[eta] = sp.to_plan(drop_idle_streams(sp, outcome.indices) if sp.tails else outcome.indices,
                                           "search")
        if best is None or _better(outcome.evaluation, best[1].evaluation):
            best = (sp, outcome)
    space, outcome = best
    ev = outcome.evaluation
    if not ev["feasible"]:
        raise NoFitError(oom_message(space, outcome.indices, ev))
    plan = space.to_plan(outcome.indices, "search")
    indices, unfused, fused = outcome.indices, None, None
    if plan.fused:  # the best plan without fusion, beside it (half the time again)
        other = unfused_search(space, outcome.indices, starts, time_limit=None if share is None else share / 2,
                               max_evals=None if evals is None else max(1, evals // 2), seed=seed,
                               n_threads=n_threads, n_chains=n_chains or n_threads, converge=converge)
        unfused = space.to_plan(other.indices, "search (no fusion)")
        if _better(other.evaluation, ev):  # the second search found a faster plan without fusion: it wins
            plan, fused, indices, ev = space.to_plan(other.indices, "search"), plan, other.indices, other.evaluation
    if space.tails and (kept := drop_idle_streams(space, indices)) is not indices:
        # a stream entry that streams to no call is dropped and the plan re-priced; the plan found without any
        # tail entry wins when that leaves it faster (it can: the entry's price was a schedule-order artefact)
        if no_tail is not None and no_tail.staleness == space.problem.staleness:
            start = space.indices_of(no_tail)
            kept = start if _better(space.evaluate(start), space.evaluate(kept)) else kept
        indices, ev = kept, space.evaluate(kept)
        plan = space.to_plan(indices, "search")
    if no_tail is not None:
        # the winner's placement without its migration (the winner itself, when it has none) may beat the plan
        # found without migration
        # (none when that placement's plain row was pruned, slower alone than a baseline's iteration)
        bare = untailed_indices(space, plan, set(plan.tail)) if plan.tail else None
        placed = plan if not plan.tail else space.to_plan(bare, "search") if bare is not None else no_tail
        no_tail = placed if placed.estimated_time < no_tail.estimated_time else no_tail
        if plan.tail and no_tail.staleness == space.problem.staleness:
            # a short search may end on a tail entry that costs more than it saves: then no tail wins
            start = space.indices_of(no_tail)
            if _better(space.evaluate(start), ev):
                indices, ev = start, space.evaluate(start)
                plan = space.to_plan(indices, "search")
    return SearchReport(spec=spec, graph=graph, space=space, plan=plan, indices=indices, evaluation=ev,
                        baselines=results, stats=outcome.stats, prepare_seconds=prepare,
                        n_candidates_before_time_pruning=before, by_staleness=by_staleness, alone=alone,
                        alone_pool=alone_pool, unfused=unfused, fused=fused, no_tail=no_tail, alone_error=alone_error)


def unfused_search(space: PlanSpace, best: np.ndarray, starts: list[np.ndarray], **search: Any):
    """The search of ``space`` without fusion (docs/fused-training.md): the MCMC again with no fuse moves, from
    the fused winner's placements unfused and the search's other starts (``search``: run_mcmc's budget)."""
    n = space.problem.n_calls
    off = [np.r_[s[:n], np.zeros(len(s) - n, np.int32)].astype(np.int32) for s in [best, *starts]]
    return run_mcmc(space, starts=off, p_fuse=0.0, **search)


def _better(a: dict, b: dict) -> bool:
    """Fitting first, then cost (as the engine ranks plans, csrc/mcmc.h)."""
    return a["feasible"] > b["feasible"] or (a["feasible"] == b["feasible"] and a["cost"] < b["cost"])


def oom_message(space: PlanSpace, indices: np.ndarray, ev: dict) -> str:
    p = space.problem
    cluster = space.graph.spec.cluster
    dev = int(ev["peak_device"])
    call = p.call_names[ev["peak_call"]] if ev["peak_call"] >= 0 else None
    where = f"device {dev} ({cluster.device_name(dev)})"
    what = f"while call {call!r} runs there" if call else "from the models resident there"
    return (f"nothing fits in memory: the best plan found still needs {fmt_bytes(ev['peak_memory'])} on {where} "
            f"{what}, {fmt_bytes(ev['overflow'])} more than the {fmt_bytes(cluster.device_memory)} a device "
            f"has; use more or larger devices, or a smaller batch or model")


@dataclasses.dataclass(frozen=True)
class RunLimits:
    """What ``realloc run``'s runtime cannot carry out, so its search leaves it out: fused train pairs when told
    not to fuse (``fused_pairs``; they run on gloo and NCCL). Tails (migration, streaming) run at any staleness and
    with ``balance_tokens`` (graph/streaming.py, runtime/control/master_tail.py); the search never offers one at
    pp > 1."""

    fused_pairs: bool = True  # False: no fused train pairs (`realloc run --no-fused-pairs`, docs/fused-training.md)


def search(experiment: Any, time_limit: float | None = 10.0, **kwargs: Any) -> ExecutionPlan:
    """The searched ExecutionPlan of ``experiment`` (see ``plan_search`` for the options)."""
    return plan_search(experiment, time_limit, **kwargs).plan
