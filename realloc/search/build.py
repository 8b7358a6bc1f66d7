"""From an experiment to the search's arrays: candidates priced by the estimator.

``PlanSpace.build(graph)`` enumerates every call's placements (``candidates.py``; training
calls with and without activation recomputation), prices their time and per-stage memory
with ``CostModel``, prunes the ones that can never run or never win
(``candidates.prune``), and numbers layouts so that the
engine can ask for transfer costs by pair. Those pair costs (parameter reallocation
per model, data transfer per data edge) are priced lazily, only for the pairs a
plan actually uses (``price_missing``): the estimator prices one pair in
milliseconds, and there are millions of pairs on large clusters.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Callable, Iterable, Sequence

import numpy as np

from realloc.cluster import DeviceMesh
from realloc.estimator.cost import CostModel
from realloc.estimator.memory import stage_call_memory
from realloc.graph.dataflow import DATA, DataflowGraph
from realloc.graph.plan import CallPlacement, ExecutionPlan, validate_plan
from realloc.graph.tail import same_tail
from realloc.search.candidates import CallCosts, Candidate, Option, call_options, footprint, prune
from realloc.search.fused_space import fused_pair_arrays, price_fused_entry
from realloc.search.home_keep import home_keep_fields
from realloc.search.pool_space import pool_fields
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem, copy_pair_costs
from realloc.search.tail_space import TailChoice, eligible, split_times, tail_arrays, with_tail_rows
from realloc.strategy import ParallelStrategy

Layout = tuple[DeviceMesh, ParallelStrategy]

# realhf.txt §4 unrolls the graph over iterations; a plan is priced over a window of them (csrc/problem.h,
# docs/search.md "The price of a plan"): (T_8 - T_2) / 6. The first iteration is a warm-up (nothing of a previous
# iteration to queue behind); the window spans 6 iterations, so a schedule that repeats every 1, 2, 3 or 6
# iterations averages exactly; 2 lookahead iterations after it give the last priced iteration's calls the next
# iterations' calls to queue behind, as in a long run. Without them a plan whose calls of iteration t run after
# calls of t + 1 was priced low (FlexRLHF Table III's best A100 plan: 17.47 s over 4 iterations, 19.8 s long-run).
WARMUP_ITERATIONS = 1
PRICED_STEPS = 6
LOOKAHEAD_ITERATIONS = 2
DEFAULT_ITERATIONS = WARMUP_ITERATIONS + PRICED_STEPS + 1 + LOOKAHEAD_ITERATIONS
# Iterations simulated per unit of staleness on top, as more warm-up: generation running ahead starts on the first
# parameters for eta iterations, a transient left out of the window.
ASYNC_EXTRA_ITERATIONS = 3


def async_lookahead(staleness: int) -> int:
    """Lookahead iterations simulated on top at ``staleness``: the train step of the last priced iteration t waits
    for the generation of t + eta (the runtime's one copy, csrc/stale.cpp), which must be simulated."""
    return max(0, staleness - LOOKAHEAD_ITERATIONS)
# Priced pairs a table needs before its median stands in for unpriced ones.
PROVISIONAL_MIN_KNOWN = 5
# realhf.txt §5.2: "alpha is a large integer representing the OOM penalty".
OOM_ALPHA = 100.0


def window_fields(n_iterations: int) -> dict[str, int]:
    """The priced window of a graph unrolled over ``n_iterations`` (at least 6): warm-up and lookahead."""
    if n_iterations < WARMUP_ITERATIONS + LOOKAHEAD_ITERATIONS + 3:
        raise ValueError(f"n_iterations={n_iterations}: the planner prices a plan over the iterations between "
                         f"{WARMUP_ITERATIONS} warm-up and {LOOKAHEAD_ITERATIONS} lookahead iterations; use at least "
                         f"{WARMUP_ITERATIONS + LOOKAHEAD_ITERATIONS + 3} (default {DEFAULT_ITERATIONS})")
    return dict(warmup=WARMUP_ITERATIONS, lookahead=LOOKAHEAD_ITERATIONS)


class NoFitError(ValueError):
    """No plan fits in device memory; the message names the smallest shortfall."""


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _no_fit_message(call: str, cc: "CallCosts", device_memory: int, nodelist: str) -> str:
    i = min(range(len(cc.options)), key=lambda i: footprint(cc.static[i], cc.dynamic[i], cc.param[i]))
    need = footprint(cc.static[i], cc.dynamic[i], cc.param[i])
    return (f"nothing fits in memory: call {call!r} needs at least {fmt_bytes(need)} on one device even alone (its "
            f"smallest footprint: {cc.options[i].describe()}), {fmt_bytes(need - device_memory)} more than the "
            f"{fmt_bytes(device_memory)} of a device of {nodelist!r}; use more or larger devices, or a smaller "
            f"batch or model")


def canonical_layouts(graph: DataflowGraph, src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """The same two layouts with the nodes they use relabelled 0, 1, ... in order.

    On a homogeneous cluster (realhf.txt §4: identical devices, one intra- and one
    inter-node bandwidth) a transfer's cost depends only on which devices share a node
    and on the devices' order, which the relabelling keeps; pairs that differ by where
    they sit then share one estimate.
    """
    cluster = graph.spec.cluster
    if cluster.pools:  # kinds and links differ between pools: only the layouts themselves say what it costs
        return src, dst
    used = sorted({n for mesh, _ in (src, dst) for n in range(mesh.first_node, mesh.first_node + mesh.n_nodes)})
    rank = {n: i for i, n in enumerate(used)}

    def move(layout: Layout) -> Layout:
        mesh, s = layout
        first = rank[mesh.first_node]
        return DeviceMesh(cluster.nodes[first:first + mesh.n_nodes], first, mesh.dev_start, mesh.n_devs,
                          mesh.devices_per_node), s

    return move(src), move(dst)


def home_calls(graph: DataflowGraph) -> dict[str, str]:
    """Each model's home call: its first train call, else its first call (estimator/memory.py rule 1)."""
    out = {}
    for model in graph.model_types:
        calls = [c for c in graph.topo_order if graph.call(c).model_name == model]
        trains = [c for c in calls if graph.call(c).is_train]
        out[model] = trains[0] if trains else calls[0]
    return out


def offloadable(graph: DataflowGraph, call: str) -> bool:
    """A frozen model with parameters and one call may wait in host memory between its calls.

    (With several calls, offloading would be one choice shared by all of them.)
    """
    model = graph.call(call).model_name
    calls = graph.calls_of_model(model)
    return graph.model_config(call) is not None and len(calls) == 1 and not graph.call(call).is_train


def price_options(graph: DataflowGraph, cost: CostModel, call: str, options: Sequence[Option], is_home: bool,
                  device_memory: int | None = None, keep: set[Candidate] = frozenset(),
                  offload: bool = False) -> CallCosts:
    """The estimator's per-stage memory and time of each option (memory.py rules 2-3).

    With ``offload``, each option also comes offloaded: no static parameters, a copy while
    the call runs, and the host-to-device load before it (``CostModel.offload_cost``).
    With ``device_memory``, candidates that cannot fit even alone (``candidates.footprint``)
    are dropped before their time is estimated, unless they are in ``keep``.
    """
    cfg = graph.model_config(call)
    model = graph.call(call).model_name
    trainable = graph.call(call).is_train
    work = cost.workload(call)
    memo: dict[tuple[int, ParallelStrategy, int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    kept, static, dynamic, param = [], [], [], []
    cluster = graph.spec.cluster
    for mesh, s, m, rc in options:
        # memory depends on the pool's dtype; the memory a device has, on the pool's kind
        mem = memo.get((mesh.pool, s, m, rc))
        limit = None if device_memory is None else min(device_memory, cluster.memory_of(mesh))
        if mem is None:
            if cfg is None:
                zeros = np.zeros(s.pp, np.int64)
                mem = (zeros, zeros, zeros)
            else:
                st = [stage_call_memory(cfg, work, s, m, k, cost.at(mesh).call_precision(call), rc)
                      for k in range(s.pp)]
                mem = (np.array([x.params + (x.optimizer if trainable else 0) for x in st], np.int64)
                       if is_home else np.zeros(s.pp, np.int64),
                       np.array([x.dynamic for x in st], np.int64),
                       np.array([x.params for x in st], np.int64))
            memo[mesh.pool, s, m, rc] = mem
        variants = [(False, mem)]
        if offload:
            variants.append((True, (np.zeros_like(mem[0]), mem[1] + mem[2], mem[2])))
        for off, (st_, dy, pa) in variants:
            cand = Candidate(mesh, s, m, rc, off)
            if limit is not None and footprint(st_, dy, pa) > limit and cand not in keep:
                continue
            kept.append(cand)
            static.append(st_)
            dynamic.append(dy)
            param.append(pa)
    times = np.array([cost.call_cost(call, mesh, s, m, rc).time + (cost.offload_cost(model, (mesh, s)) if off else 0.0)
                      for mesh, s, m, rc, off in kept], np.float64)
    return CallCosts(tuple(kept), times, tuple(static), tuple(dynamic), tuple(param))


@dataclasses.dataclass
class PlanSpace:
    """The candidate placements of every call and the engine problem over them.

    ``options[c][i]`` is candidate i of call c (the c-th call in topological order);
    ``layouts[m][j]`` is layout j of model m. Pair costs are shared by every space
    restricted from this one, so a pair is priced once.
    """

    graph: DataflowGraph
    cost: CostModel
    problem: SearchProblem
    options: tuple[tuple[Candidate, ...], ...]
    layouts: tuple[tuple[Layout, ...], ...]
    pruned: dict[str, dict[str, int]]  # call -> reason -> count
    # Long-tail migration (search/tail_space.py): per call and candidate its migration, or None; () when none
    tails: tuple[tuple[TailChoice | None, ...], ...] = ()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def build(cls, graph: DataflowGraph, cost: CostModel | None = None, *, keep: Iterable[ExecutionPlan] = (),
              option_filter: Callable[[str, Option], bool] | None = None, prune_memory: bool = True,
              offload: bool = True, n_iterations: int = DEFAULT_ITERATIONS,
              max_n_mbs: int | None = None, migrate: bool = True, pp_streams: bool = False) -> "PlanSpace":
        """Every useful placement of every call; the placements of ``keep`` plans always stay.

        ``option_filter(call, option)`` restricts the space (e.g. to a baseline's options);
        ``prune_memory=False`` keeps placements that cannot fit, so that an OOM plan can be reported;
        ``offload`` lets frozen single-call models wait in host memory (``offloadable``); ``migrate`` lets generation
        calls migrate their long tail (``search/tail_space.py``; baselines do not); ``pp_streams`` prices streaming at
        pp > 1 too (a hand plan's estimate, ``estimator/pp_stream_cost.py``).
        """
        cost = cost or CostModel(graph)
        cluster = graph.spec.cluster
        calls = graph.topo_order
        homes = home_calls(graph)
        kept: dict[str, set[Candidate]] = {c: set() for c in calls}
        for plan in keep:
            meshes = validate_plan(plan, graph)
            for c in calls:
                p = plan.placements[c]
                kept[c].add(Candidate(meshes[c], p.strategy, p.n_mbs, p.recompute,
                                      bool(plan.offload.get(graph.call(c).model_name))))
        priced, pruned = [], {}
        for c in calls:
            opts = call_options(graph, c, cluster, **({"max_n_mbs": max_n_mbs} if max_n_mbs else {}))
            opts = list(dict.fromkeys(opts + sorted({k.option for k in kept[c]} - set(opts), key=str)))
            if option_filter is not None:
                opts = [o for o in opts if option_filter(c, o)]
                if not opts:
                    raise ValueError(f"call {c!r}: no placement of cluster {cluster.nodelist!r} satisfies this plan "
                                     f"space's rules")
            mem = cluster.device_memory if prune_memory else None
            home = homes[graph.call(c).model_name] == c
            off = offload and offloadable(graph, c)
            cc = price_options(graph, cost, c, opts, home, mem, kept[c], off)
            if not cc.options:  # nothing fits: price everything, to say by how much
                cc = price_options(graph, cost, c, opts, home, offload=off)
            keep_rows, reasons = prune(cc, mem, kept[c])
            reasons["memory"] += len(opts) * (2 if off else 1) - len(cc.options)
            pruned[c] = reasons
            priced.append(CallCosts(tuple(cc.options[i] for i in keep_rows), cc.time[keep_rows],
                                    tuple(cc.static[i] for i in keep_rows), tuple(cc.dynamic[i] for i in keep_rows),
                                    tuple(cc.param[i] for i in keep_rows)))
            if not keep_rows:
                raise NoFitError(_no_fit_message(c, cc, cluster.device_memory, cluster.nodelist))
        tails = []
        for i, c in enumerate(calls):  # long-tail migration: one more choice of a generation call's rows
            priced[i], choices = (with_tail_rows(graph, cost, c, priced[i], pp_streams)
                                  if migrate and eligible(graph, c) else (priced[i], (None,) * len(priced[i].options)))
            tails.append(choices)
        return cls._assemble(graph, cost, priced, pruned, n_iterations, tails=tails)

    @classmethod
    def _assemble(cls, graph: DataflowGraph, cost: CostModel, priced: list[CallCosts],
                  pruned: dict[str, dict[str, int]], n_iterations: int,
                  pair_costs: dict[int, PairCosts] | None = None,
                  layouts_in: tuple[tuple[Layout, ...], ...] | None = None,
                  tails: Sequence[Sequence[TailChoice | None]] = ()) -> "PlanSpace":
        cluster = graph.spec.cluster
        tails = tuple(tuple(t) for t in tails) if any(x is not None for t in tails for x in t) else ()
        calls = graph.topo_order
        models = tuple(dict.fromkeys(graph.call(c).model_name for c in calls))
        homes = home_calls(graph)
        # Meshes are frozen dataclasses: keying by the object avoids formatting their names.
        mesh_index = {m: i for i, m in enumerate(cluster.device_meshes())}
        if layouts_in is None:
            layout_ids: list[dict[tuple[DeviceMesh, ParallelStrategy], int]] = [{} for _ in models]
            for c, cc in zip(calls, priced):
                ids = layout_ids[models.index(graph.call(c).model_name)]
                for mesh, s, *_ in cc.options:
                    ids.setdefault((mesh, s), len(ids))
            layouts = tuple(tuple(ids) for ids in layout_ids)
        else:
            layouts = layouts_in
            layout_ids = [{(mesh, s): j for j, (mesh, s) in enumerate(lays)} for lays in layouts]
        arrays = []
        for ci, (c, cc) in enumerate(zip(calls, priced)):
            ids = layout_ids[models.index(graph.call(c).model_name)]
            shapes: dict[tuple, int] = {}
            # a migration keeps its own shape class: the MCMC's position moves keep it (search/tail_space.py)
            tail_key = [() if not tails or t is None else (t.grid, t.migration.instances)
                        for t in (tails[ci] if tails else [None] * len(cc.options))]
            pp = [s.pp for _, s, *_ in cc.options]
            row = {cand: i for i, cand in enumerate(cc.options)}
            twin = [row.get(cand._replace(recompute=not cand.recompute), -1) for cand in cc.options]
            arrays.append(CandidateArrays(
                dev_lo=[mesh.device_ids[0] for mesh, *_ in cc.options],
                dev_hi=[mesh.device_ids[-1] + 1 for mesh, *_ in cc.options],
                stage_width=[s.dp * s.tp for _, s, *_ in cc.options],
                layout=[ids[mesh, s] for mesh, s, *_ in cc.options],
                mesh_id=[mesh_index[mesh] for mesh, *_ in cc.options],
                shape_class=[shapes.setdefault((mesh.shape, s, m, rc, off, *tk), len(shapes))
                             for (mesh, s, m, rc, off), tk in zip(cc.options, tail_key)],
                time=cc.time, twin=twin, mem_offset=np.r_[0, np.cumsum(pp)].astype(np.int64),
                whole=[int(s.tp == 1 and s.pp == 1) for _, s, *_ in cc.options],
                mem_static=np.concatenate(cc.static) if pp else [], mem_dynamic=np.concatenate(cc.dynamic) if pp else [],
                mem_param=np.concatenate(cc.param) if pp else []))
        index = {c: i for i, c in enumerate(calls)}
        data_edges, order_edges = [], []
        for u, v, attrs in graph.graph.edges(data=True):
            (data_edges if attrs["kind"] == DATA else order_edges).append((index[u], index[v]))
        data_edges.sort()
        order_edges.sort()
        carry = tuple(sorted((index[u], index[v]) for u, v in graph.carry_edges))
        n_layouts = [len(x) for x in layouts]
        model_of = [models.index(graph.call(c).model_name) for c in calls]
        pair_costs = pair_costs or {}
        n_m = len(models)
        realloc = tuple(pair_costs.get(m) or PairCosts(n_layouts[m], n_layouts[m]) for m in range(n_m))
        data = tuple(pair_costs.get(n_m + e) or PairCosts(n_layouts[model_of[u]], n_layouts[model_of[v]])
                     for e, (u, v) in enumerate(data_edges))
        tail_fields = {}
        if tails:
            columns, splits = tail_arrays(graph, cost, calls, [cc.options for cc in priced], tails, data_edges)
            tail_fields = dict(tail_columns=columns, tail_splits=splits)
        problem = SearchProblem(
            n_devices=cluster.n_devices, device_memory=cluster.device_memory, call_names=calls,
            call_model=tuple(model_of), model_names=models,
            model_home=tuple(index[homes[m]] for m in models), candidates=tuple(arrays),
            order_edges=tuple(order_edges), carry_edges=carry, data_edges=tuple(data_edges), data_costs=data,
            realloc_costs=realloc, n_iterations=n_iterations, oom_alpha=OOM_ALPHA, **window_fields(n_iterations),
            dispatch_latency=cost.hw.dispatch_latency, **pool_fields(cluster), **tail_fields,
            **home_keep_fields(cluster, graph, calls))
        options = tuple(cc.options for cc in priced)
        problem = dataclasses.replace(problem, fused=fused_pair_arrays(graph, problem, options))  # fused_space.py
        return cls(graph=graph, cost=cost, problem=problem, options=tuple(cc.options for cc in priced),
                   layouts=layouts, pruned=pruned, tails=tails)

    def restrict(self, keep: Sequence[Sequence[int]]) -> "PlanSpace":
        """The space with only candidates ``keep[c]`` of each call; layouts and pair costs are shared."""
        p = self.problem
        priced = []
        for c, rows in enumerate(keep):
            rows = list(rows)
            if not rows:
                raise ValueError(f"call {p.call_names[c]!r}: a restricted plan space needs at least one candidate")
            k = p.candidates[c]
            priced.append(CallCosts(tuple(self.options[c][i] for i in rows), k.time[rows],
                                    tuple(k.stage_memory(i, "static") for i in rows),
                                    tuple(k.stage_memory(i, "dynamic") for i in rows),
                                    tuple(k.stage_memory(i, "param") for i in rows)))
        tables = {t: p.table(t) for t in range(p.n_models + len(p.data_edges))}
        tails = [[self.tails[c][i] for i in rows] for c, rows in enumerate(keep)] if self.tails else ()
        out = PlanSpace._assemble(self.graph, self.cost, priced, self.pruned,
                                  p.n_iterations - ASYNC_EXTRA_ITERATIONS * p.staleness - async_lookahead(p.staleness),
                                  tables, self.layouts,
                                  tails=tails)
        return out.with_staleness(p.staleness) if p.staleness else out

    def with_staleness(self, staleness: int) -> "PlanSpace":
        """The same space with generation running ``staleness`` iterations ahead (asynchronous RL): the
        simulators price the run-ahead pipeline (csrc/problem.h). It is simulated over more iterations, so
        that the steady state outweighs the start, where generation runs ahead on the first parameters."""
        why = self.graph.staleness_error(staleness)
        if why:
            raise ValueError(why)
        p = self.problem
        if staleness == p.staleness:
            return self
        base = p.n_iterations - ASYNC_EXTRA_ITERATIONS * p.staleness - async_lookahead(p.staleness)
        stale = tuple(i for i, c in enumerate(p.call_names) if c in self.graph.stale_calls) if staleness else ()
        problem = dataclasses.replace(p, staleness=staleness, stale_calls=stale,
                                      n_iterations=base + ASYNC_EXTRA_ITERATIONS * staleness + async_lookahead(staleness),
                                      warmup=p.warmup - ASYNC_EXTRA_ITERATIONS * (p.staleness - staleness),
                                      lookahead=p.lookahead - async_lookahead(p.staleness) + async_lookahead(staleness))
        return dataclasses.replace(self, problem=problem)

    @cached_property
    def cpp(self):
        return self.problem.to_cpp()

    # -- pricing pair costs --------------------------------------------------------------
    def price_missing(self, missing: np.ndarray) -> int:
        """Price (table, a, b) rows with the estimator; returns how many were new."""
        return self.apply_prices(self.compute_prices(missing))

    def compute_prices(self, missing: np.ndarray) -> dict[int, dict[tuple[int, int], float]]:
        """The estimator's cost of each (table, a, b) row not priced yet. Reads only: safe to run in
        another thread while the engine searches."""
        p, n_m = self.problem, self.problem.n_models
        out: dict[int, dict[tuple[int, int], float]] = {}
        for t, a, b in np.asarray(missing, np.int64).reshape(-1, 3).tolist():
            if (a, b) in p.table(t).known or (a, b) in out.get(t, ()):
                continue
            if t >= p.n_tables:  # a fused pair's saving and extra bytes, priced together (fused_space.py)
                k = (t - p.n_tables) // 2
                saving, extra = price_fused_entry(self.graph, self.cost, p, self.options, k, a, b)
                out.setdefault(p.n_tables + 2 * k, {})[a, b] = saving
                out.setdefault(p.n_tables + 2 * k + 1, {})[a, b] = extra
                continue
            if t < n_m:
                src, dst = canonical_layouts(self.graph, self.layouts[t][a], self.layouts[t][b])
                cost = self.cost.realloc_cost(p.model_names[t], src, dst)
            else:
                u, v = p.data_edges[t - n_m]
                src, dst = canonical_layouts(self.graph, self.layouts[p.call_model[u]][a],
                                             self.layouts[p.call_model[v]][b])
                cost = self.cost.data_transfer_cost(p.call_names[u], p.call_names[v], src, dst)
            out.setdefault(t, {})[a, b] = cost
        return out

    def apply_prices(self, prices: dict[int, dict[tuple[int, int], float]]) -> int:
        """Record computed prices in the tables and the engine (never while a search runs).

        An unpriced pair then reads as the median of its table's priced pairs: a typical
        cost, so that the chains are neither drawn to unpriced layouts (as by 0) nor kept
        from them.
        """
        n = 0
        for t, costs in prices.items():
            table = self.problem.table(t)
            new = {k: v for k, v in costs.items() if k not in table.known}
            table.known.update(new)
            copy_pair_costs(self.cpp, t, new)
            n += len(new)
            if new and len(table.known) >= PROVISIONAL_MIN_KNOWN and t < self.problem.n_tables:
                table.provisional = float(np.median(np.fromiter(table.known.values(), np.float64)))
                self.cpp.set_provisional(t, table.provisional)
        return n

    def sync_pair_costs(self) -> None:
        """Copy pairs priced through another space sharing these tables into this space's engine."""
        p = self.problem
        for t in range(p.n_tables + 2 * len(p.fused)):
            if self.cpp.n_known(t) != len(p.table(t).known):
                copy_pair_costs(self.cpp, t, p.table(t).known)

    def price_all_pairs(self) -> int:
        """Price every pair any plan of this space can use (for small, enumerated spaces)."""
        p, n_m = self.problem, self.problem.n_models
        rows = []
        layouts = [np.unique(k.layout) for k in p.candidates]
        for m in range(p.n_models):
            seq = [c for c in range(p.n_calls) if p.call_model[c] == m]
            if len(seq) > 1:  # from each call's layout to the next one's, around the chain (reference.py)
                for prev, c in zip([seq[-1], *seq[:-1]], seq):
                    rows += [(m, a, b) for a in layouts[prev] for b in layouts[c] if a != b]
        for e, (u, v) in enumerate(p.data_edges):
            rows += [(n_m + e, a, b) for a in layouts[u] for b in layouts[v]]
        return self.price_missing(np.asarray(rows, np.int64).reshape(-1, 3))

    def evaluate(self, indices: Sequence[int]) -> dict:
        """Exact evaluation: prices the pairs the plan needs first."""
        idx = np.asarray(indices, np.int32)
        self.sync_pair_costs()
        self.price_missing(self.cpp.missing(idx))
        ev = self.cpp.evaluate(idx)
        assert ev["exact"]
        return ev

    # -- plans ---------------------------------------------------------------------------
    def indices_of(self, plan: ExecutionPlan) -> np.ndarray:
        meshes = validate_plan(plan, self.graph)
        out = []
        for c, opts in zip(self.problem.call_names, self.options):
            p = plan.placements[c]
            off = bool(plan.offload.get(self.graph.call(c).model_name))
            want = Candidate(meshes[c], p.strategy, p.n_mbs, p.recompute, off)
            try:
                i = opts.index(want)
                if plan.tail.get(c) is not None or self.tails:  # the row with the plan's migration, if any
                    i = next(j for j, o in enumerate(opts) if o == want and same_tail(self.tail_of(c, j),
                                                                                      plan.tail.get(c)))
                out.append(i)
            except (ValueError, StopIteration):
                raise ValueError(f"call {c!r}: placement {want.describe()} is not among the candidates (it does not "
                                 f"fit in memory or was pruned)") from None
        names = self.problem.call_names
        out += [int((names[f.a], names[f.b]) in plan.fused) for f in self.problem.fused]
        return np.asarray(out, np.int32)

    def to_plan(self, indices: Sequence[int], source: str) -> ExecutionPlan:
        """The ExecutionPlan of candidate indices, with the estimator's numbers filled in."""
        idx = np.asarray(indices, np.int32)
        ev = self.evaluate(idx)
        mem = self.cpp.memory(idx)
        p, cluster = self.problem, self.graph.spec.cluster
        placements, times, memory, offload, tail = {}, {}, {}, {}, {}
        for c, name in enumerate(p.call_names):
            mesh, s, m, rc, off = self.options[c][int(idx[c])]
            placements[name] = CallPlacement.of(mesh, s, m, rc)
            times[name] = float(p.candidates[c].time[int(idx[c])])
            migration = self.tail_of(c, int(idx[c]))
            if migration is not None:
                tail[name] = migration
                times[name] += self.tails[c][int(idx[c])].tail
            memory[name] = int(mem["call_peak"][c])
            if off:
                offload[self.graph.call(name).model_name] = True
        for c, seconds in split_times(p, idx).items():  # consumers in two parts: both parts
            times[p.call_names[c]] = seconds
        return ExecutionPlan(experiment=self.graph.spec.name, graph_digest=self.graph.digest,
                             nodelist=cluster.nodelist, n_devices_per_node=cluster.n_devices_per_node,
                             device=cluster.device, placements=placements, offload=offload, source=source,
                             estimated_time=float(ev["time"]), estimated_peak_memory=int(ev["peak_memory"]),
                             call_times=times, call_memory=memory, staleness=p.staleness, tail=tail,
                             fused=tuple((p.call_names[f.a], p.call_names[f.b]) for f in p.fused if f.on(p, idx)))

    def tail_of(self, c: int | str, i: int):
        """The migration (graph.tail.TailMigration) of candidate ``i`` of call ``c``, or None."""
        c = self.problem.call_names.index(c) if isinstance(c, str) else c
        t = self.tails[c][i] if self.tails else None
        return None if t is None else t.migration

    def fastest(self) -> np.ndarray:
        """The greedy plan of realhf.txt §5.2: each call at its fastest standalone candidate."""
        return np.asarray([int(np.argmin(self.total_times(c))) for c in range(self.problem.n_calls)]
                          + [0] * len(self.problem.fused), np.int32)

    def total_times(self, c: int) -> np.ndarray:
        """Seconds of every candidate of call ``c`` alone: a migrating one's phase 1 and its tail together."""
        k = self.problem.candidates[c]
        if not self.tails:
            return k.time
        return k.time + np.array([0.0 if t is None else t.tail for t in self.tails[c]])

    @property
    def n_candidates(self) -> tuple[int, ...]:
        return tuple(len(k) for k in self.problem.candidates)
