"""The search problem as arrays: what the C++ simulator and MCMC read (csrc/problem.h).

``SearchProblem`` is engine-neutral: ``to_cpp()`` hands it to ``realloc._C`` and
``realloc.search.reference`` evaluates it in plain Python. Building one from an
experiment (candidates and estimator costs) lives in ``realloc.search.build``.

Memory rules are the estimator's (``realloc/estimator/memory.py``): a model's static
memory sits on the layout of its *home* call (its first train call, else its first
call); every call adds its dynamic memory while it runs, plus a copy of the
parameters when its layout differs from the home layout. A device's peak is its
static memory plus the largest dynamic memory of the calls that run on it. Memory is
given per pipeline stage, since stages hold different layers and activations. With bounded staleness
(``staleness`` > 0) a stale generation call's copy stays between its calls: static on its devices.

Transfer costs between two layouts (parameter reallocation per model, from the layout of
the model's previous call to the call's; data per data edge) are *pair costs*, priced
lazily: a pair not priced yet reads as the table's provisional cost and makes an
evaluation inexact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from realloc.search.tail_problem import TailColumns, TailSplit, tail_to_cpp


@dataclasses.dataclass(frozen=True)
class CandidateArrays:
    """Every placement one call may take, as columns (one row per candidate).

    Memory is per pipeline stage: candidate i's stages are entries
    ``mem_offset[i]:mem_offset[i+1]`` of the three pools, one per stage.
    """

    dev_lo: np.ndarray  # int32, first global device id of the mesh
    dev_hi: np.ndarray  # int32, one past the last
    stage_width: np.ndarray  # int32, devices per pipeline stage (dp * tp)
    layout: np.ndarray  # int32, (mesh, strategy) id within the model: indexes pair costs
    mesh_id: np.ndarray  # int32
    shape_class: np.ndarray  # int32, (mesh shape, strategy, n_mbs) id
    time: np.ndarray  # float64 seconds
    mem_offset: np.ndarray  # int64, n + 1
    mem_static: np.ndarray  # int64 pool, bytes per device
    mem_dynamic: np.ndarray  # int64 pool
    mem_param: np.ndarray  # int64 pool
    # int32: the same placement with the other activation-recomputation choice, or -1 (None: all -1);
    # only the MCMC's moves read it
    twin: np.ndarray | None = None
    # int32: 1 where every device of the mesh holds the whole model (tp 1, pp 1), so a reallocation from it into a
    # mesh inside it copies in place and occupies only the destination's devices (None: all 0)
    whole: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.twin is None:
            object.__setattr__(self, "twin", np.full(len(self.time), -1, np.int32))
        if self.whole is None:
            object.__setattr__(self, "whole", np.zeros(len(self.time), np.int32))
        for f, dtype in (("dev_lo", np.int32), ("dev_hi", np.int32), ("stage_width", np.int32),
                         ("layout", np.int32), ("mesh_id", np.int32), ("shape_class", np.int32),
                         ("time", np.float64), ("mem_offset", np.int64), ("mem_static", np.int64),
                         ("mem_dynamic", np.int64), ("mem_param", np.int64), ("twin", np.int32), ("whole", np.int32)):
            object.__setattr__(self, f, np.ascontiguousarray(getattr(self, f), dtype=dtype))
        n = len(self.time)
        assert len(self.mem_offset) == n + 1 and self.mem_offset[-1] == len(self.mem_static)
        assert np.array_equal(np.diff(self.mem_offset), (self.dev_hi - self.dev_lo) // self.stage_width)

    def __len__(self) -> int:
        return len(self.time)

    def pp(self, i: int) -> int:
        return int(self.mem_offset[i + 1] - self.mem_offset[i])

    def stage_memory(self, i: int, which: str) -> np.ndarray:
        """Per-stage bytes of candidate i from pool ``which`` (static, dynamic, param)."""
        pool = getattr(self, f"mem_{which}")
        return pool[self.mem_offset[i]:self.mem_offset[i + 1]]

    def take(self, rows: np.ndarray | list[int]) -> "CandidateArrays":
        rows = np.asarray(rows, dtype=np.int64)
        lo, hi = self.mem_offset[rows], self.mem_offset[rows + 1]
        idx = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if len(rows) else np.zeros(0, np.int64)
        pools = {f"mem_{w}": getattr(self, f"mem_{w}")[idx] for w in ("static", "dynamic", "param")}
        # a twin left out of ``rows`` is no twin any more
        new_index = np.full(len(self) + 1, -1, np.int64)
        new_index[rows] = np.arange(len(rows))
        twin = new_index[np.where(self.twin[rows] >= 0, self.twin[rows], len(self))]
        return CandidateArrays(dev_lo=self.dev_lo[rows], dev_hi=self.dev_hi[rows],
                               stage_width=self.stage_width[rows], layout=self.layout[rows],
                               mesh_id=self.mesh_id[rows], shape_class=self.shape_class[rows],
                               time=self.time[rows], mem_offset=np.r_[0, np.cumsum(hi - lo)], twin=twin,
                               whole=self.whole[rows], **pools)


@dataclasses.dataclass
class PairCosts:
    """Seconds to move from layout a to layout b; only priced pairs are known."""

    n_src: int
    n_dst: int
    known: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    provisional: float = 0.0

    @classmethod
    def dense(cls, table: np.ndarray) -> "PairCosts":
        rows, cols = table.shape
        return cls(rows, cols, {(a, b): float(table[a, b]) for a in range(rows) for b in range(cols)})

    def get(self, a: int, b: int) -> tuple[float, bool]:
        v = self.known.get((a, b))
        return (self.provisional, False) if v is None else (v, True)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedPairArrays:
    """Two train calls a plan may fuse (csrc/fused_node.h): ``saving`` and ``extra`` are keyed by (a's candidate,
    b's candidate): the seconds per iteration fusion saves and the activation bytes it adds per device;
    ``bound_a``/``bound_b`` per candidate bound the saving while it is not priced."""

    a: int
    b: int
    bound_a: np.ndarray  # float64, per candidate of a
    bound_b: np.ndarray
    saving: PairCosts
    extra: PairCosts

    def fused_time(self, p: "SearchProblem", i: int, j: int) -> tuple[float, bool]:
        """Seconds the fused node lasts with candidates (i, j), and whether its saving is priced (unpriced: the
        bounds); never less than the longer call alone (fused_node.h)."""
        ta, tb = float(p.candidates[self.a].time[i]), float(p.candidates[self.b].time[j])
        v, known = self.saving.get(i, j)
        if not known:
            v = float(self.bound_a[i]) + float(self.bound_b[j])
        return max(max(ta, tb), ta + tb - v), known

    def on(self, p: "SearchProblem", plan) -> bool:
        """Whether the pair is fused under ``plan``: its entry is 1 and both calls share devices and pp."""
        k = p.fused.index(self)
        if len(plan) <= p.n_calls + k or not int(plan[p.n_calls + k]):  # a plan of n_calls entries fuses nothing
            return False
        ka, kb, i, j = p.candidates[self.a], p.candidates[self.b], int(plan[self.a]), int(plan[self.b])
        return (int(ka.dev_lo[i]), int(ka.dev_hi[i]), ka.pp(i)) == (int(kb.dev_lo[j]), int(kb.dev_hi[j]), kb.pp(j))


@dataclasses.dataclass(frozen=True)
class SearchProblem:
    n_devices: int
    device_memory: int
    call_names: tuple[str, ...]  # topological order
    call_model: tuple[int, ...]
    model_names: tuple[str, ...]
    model_home: tuple[int, ...]
    candidates: tuple[CandidateArrays, ...]
    order_edges: tuple[tuple[int, int], ...]  # inside an iteration, no transfer (parameter versions)
    carry_edges: tuple[tuple[int, int], ...]  # (u at t, v at t+1)
    data_edges: tuple[tuple[int, int], ...]  # inside an iteration, through a transfer node
    data_costs: tuple[PairCosts, ...]  # per data edge: src model layouts x dst model layouts
    realloc_costs: tuple[PairCosts, ...]  # per model: previous call's layout -> call's layout
    n_iterations: int = 4
    oom_alpha: float = 100.0
    # The priced window (csrc/problem.h): of the n_iterations unrolled, the first ``warmup`` and the last
    # ``lookahead`` are simulated but not priced; 0 and 0: (T_K - T_1) / (K - 1).
    warmup: int = 0
    lookahead: int = 0
    # Seconds between the end of a call or reallocation and the dispatch of what waited for it (the
    # runtime's master round trip); a delay on the edges out of call and reallocation nodes.
    dispatch_latency: float = 0.0
    # Hosts of ``devices_per_node`` consecutive devices share ``cores_per_node`` CPU cores; 0: enough.
    devices_per_node: int = 0
    cores_per_node: float = 0.0
    # Bounded staleness (csrc/problem.h): generation runs ``staleness`` iterations ahead; ``stale_calls`` are
    # the generation calls of trained models (call indices), read only when staleness > 0.
    staleness: int = 0
    stale_calls: tuple[int, ...] = ()
    # A cluster of pools (docs/heterogeneous.md): pool i holds devices [pool_start[i], pool_start[i + 1]) (the
    # last to n_devices), each with pool_memory[i] usable bytes. Empty: every device has device_memory.
    pool_start: tuple[int, ...] = ()
    pool_memory: tuple[int, ...] = ()
    # A home that keeps its parameters across a narrowing trip (search/home_keep.py): pool_narrows[a][b] when a
    # trip from pool a's dtype into pool b's rounds, and the train calls. Empty: no pair of pools narrows.
    pool_narrows: tuple[tuple[bool, ...], ...] = ()
    train_calls: tuple[int, ...] = ()
    # Fused train pairs (csrc/fused_node.h): a plan then has n_calls + len(fused) entries (a 0/1 per pair last).
    fused: tuple[FusedPairArrays, ...] = ()
    # Long-tail migration (search/tail_problem.py): (call, its candidates' migrations), and the consumers that
    # may run in two parts. Empty: no call migrates, the graph of before.
    tail_columns: tuple[tuple[int, TailColumns], ...] = ()
    tail_splits: tuple[TailSplit, ...] = ()

    @property
    def priced_window(self) -> tuple[int, int]:
        """(first, last): the plan costs (T_last - T_first) / (last - first) per iteration (0-based)."""
        return self.warmup, self.n_iterations - 1 - self.lookahead

    def capacity(self, device: int) -> int:
        """Usable bytes of ``device`` (its pool's)."""
        if not self.pool_start:
            return self.device_memory
        return self.pool_memory[max(i for i, lo in enumerate(self.pool_start) if lo <= device)]

    @property
    def host_size(self) -> int:
        return self.devices_per_node or self.n_devices

    @property
    def shares_cores(self) -> bool:
        """Whether more devices of a host can be busy than it has cores (csrc/simulator.h)."""
        return 0.0 < self.cores_per_node < self.host_size

    @property
    def n_calls(self) -> int:
        return len(self.call_names)

    @property
    def n_models(self) -> int:
        return len(self.model_names)

    @property
    def n_tables(self) -> int:
        """Reallocation and data tables; fused pair k's are n_tables + 2k (saving) and + 1 (extra bytes)."""
        return self.n_models + len(self.data_edges)

    def table(self, table_id: int) -> PairCosts:
        """Pair-cost table by the engine's id: a model index, or n_models + data edge index."""
        if table_id >= self.n_tables:
            f = self.fused[(table_id - self.n_tables) // 2]
            return f.extra if (table_id - self.n_tables) % 2 else f.saving
        return self.realloc_costs[table_id] if table_id < self.n_models else self.data_costs[table_id - self.n_models]

    def to_cpp(self, engine=None):
        """The same problem as a finalized ``realloc._C.Problem`` (or of ``engine``, a build of ``realloc._C``
        from another revision that a benchmark compares with)."""
        from realloc import _C

        engine = engine or _C

        p = engine.Problem(n_devices=self.n_devices, n_iterations=self.n_iterations, device_memory=self.device_memory,
                       oom_alpha=self.oom_alpha, call_model=np.asarray(self.call_model, np.int32),
                       model_home=np.asarray(self.model_home, np.int32), dispatch_latency=self.dispatch_latency,
                       devices_per_node=self.devices_per_node, cores_per_node=self.cores_per_node)
        for c, k in enumerate(self.candidates):
            # an older engine (a benchmark's comparison) prices every reallocation on both meshes
            whole = {"whole": k.whole} if k.whole.any() and engine is _C else {}
            p.set_candidates(c, k.dev_lo, k.dev_hi, k.stage_width, k.layout, k.mesh_id, k.shape_class, k.time,
                             k.mem_offset, k.mem_static, k.mem_dynamic, k.mem_param, k.twin, **whole)
        for m, t in enumerate(self.realloc_costs):
            assert t.n_src == t.n_dst
            p.set_realloc_layouts(m, t.n_src)
        for (u, v), t in zip(self.data_edges, self.data_costs):
            p.add_data_edge(u, v, t.n_src, t.n_dst)
        for table_id in range(self.n_models + len(self.data_edges)):
            t = self.table(table_id)
            p.set_provisional(table_id, t.provisional)
            copy_pair_costs(p, table_id, t.known)
        p.set_edges(np.asarray(self.order_edges, np.int32).reshape(-1, 2),
                    np.asarray(self.carry_edges, np.int32).reshape(-1, 2))
        if self.warmup or self.lookahead:
            p.set_window(self.warmup, self.lookahead)
        if self.staleness:
            p.set_staleness(self.staleness, np.asarray(self.stale_calls, np.int32))
        if self.pool_start:
            p.set_pools(np.asarray(self.pool_start, np.int32), np.asarray(self.pool_memory, np.int64))
        if self.pool_narrows:
            p.set_home_keep(np.asarray(self.pool_narrows, np.uint8).reshape(-1), np.asarray(self.train_calls, np.int32))
        for f in self.fused:
            t = p.add_fused_pair(f.a, f.b, np.asarray(f.bound_a, np.float64), np.asarray(f.bound_b, np.float64))
            copy_pair_costs(p, t, f.saving.known)
            copy_pair_costs(p, t + 1, f.extra.known)
        tail_to_cpp(self, p)
        p.finalize()
        return p


def copy_pair_costs(cpp_problem, table_id: int, costs: dict[tuple[int, int], float]) -> None:
    if not costs:
        return
    keys = np.array(list(costs), np.int32).reshape(-1, 2)
    cpp_problem.set_pair_costs(table_id, keys[:, 0], keys[:, 1], np.fromiter(costs.values(), np.float64, len(costs)))
