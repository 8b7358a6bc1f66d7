"""What the runtime derives from an execution plan; shared by the master and every model worker.

Both sides compute it from the same (experiment, plan), so they agree without talking:

- the layout of every call, and the distinct layouts of every model;
- each model's *chain*: its calls in topological order, cut into segments of consecutive calls
  that share a layout. Between two segments the parameters move (a reallocation node); the last
  segment wraps around to the first one of the next iteration. The last segment's layout is the
  model's *home*: parameters live there between iterations, so that is where they are
  initialized, checkpointed and loaded (for a trained model, the layout of its train step, where
  its optimizer state stays);
- where each call's outputs live (producer data layout) and where its inputs are needed
  (consumer data layout), for the data-transfer planner;
- every process group the run needs, so all workers create them at start-up, in one order.

With bounded staleness (``plan.staleness`` eta > 0, asynchronous RL) a trained model's generation calls
(``DataflowGraph.stale_calls``) leave its chain: the chain and its segments hold the other calls only, and
the parameters stay at home between them. A generation call in the home layout reads the parameters in
place; one in a layout of its own gets a *snapshot*, a reallocation from home that copies (keeps the
source), after the train step of iteration t - 1 - eta, into a copy that only the generation calls read
while training goes on elsewhere (``master_schedule.py`` orders them).
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from realloc.api import InterfaceType
from realloc.cluster import DeviceMesh
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.fused import second_model_meshes
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.graph.streaming import check_runtime_tail
from realloc.graph.transfer_plan import DataLayout, Layout, TransferPlan, plan_data_transfer, plan_param_realloc
from realloc.models.config import ModelConfig
from realloc.strategy import ParallelStrategy

# Parameters are in the dtype the cluster's devices compute in (its hardware spec, or its pool's ``dtype``):
# float32 on the CPU devices (gloo, exact comparisons), bfloat16 on GPUs (with fp32 master weights in the
# optimizer), float16 on kinds without bf16 (V100); reallocation plans count bytes with the element size.
PARAM_DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}

LayoutKey = tuple[str, str, int, int, int]  # (model, mesh name, dp, tp, pp)


@dataclasses.dataclass(frozen=True)
class CallLayout:
    call: str
    model: str
    mesh: DeviceMesh
    strategy: ParallelStrategy
    n_mbs: int
    recompute: bool = False  # a train step recomputes activations (the layout does not change)

    @property
    def key(self) -> LayoutKey:
        s = self.strategy
        return (self.model, self.mesh.name, s.dp, s.tp, s.pp)

    @property
    def layout(self) -> Layout:
        return Layout(self.mesh, self.strategy)

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.mesh.device_ids


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive calls of one model (within an iteration) that use one layout."""

    model: str
    key: LayoutKey
    calls: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Realloc:
    """Move ``model``'s parameters from the layout of ``src_call`` to that of ``dst_call``.

    It waits for every call of the segment ``after`` (of the previous iteration when
    ``wraps``), and the calls of the segment that starts with ``dst_call`` wait for it.
    """

    model: str
    src_call: str
    dst_call: str
    after: tuple[str, ...]
    wraps: bool
    snapshot: bool = False  # a copy for generation running ahead: the source keeps its parameters


class RuntimeProgram:
    def __init__(self, graph: DataflowGraph, plan: ExecutionPlan) -> None:
        meshes = validate_plan(plan, graph)
        self.graph = graph
        self.plan = plan
        spec = graph.spec
        sizes = {spec.n_seqs(r) for r in spec.rpcs}
        if len(sizes) != 1:
            raise ValueError(f"experiment {spec.name!r}: the runtime needs every call to process the same batch "
                             f"(n_seqs differs: {sorted(sizes)}); leave n_seqs unset or make them equal")
        self.batch_size = sizes.pop()
        self.staleness = plan.staleness
        # one pool: its dtype; several pools: the first pool's (each layout's own is ``dtype_of``)
        self.param_dtype, self.bytes_per_param = PARAM_DTYPES[spec.cluster.hardware.dtype]
        self.calls: dict[str, CallLayout] = {}
        self.movers: dict[Realloc, frozenset[int]] = {}  # realloc_movers, computed once per reallocation
        # a fused pair's second model runs its stages in reverse order (graph/fused.py)
        meshes = second_model_meshes(graph, meshes, {c: p.strategy.pp for c, p in plan.placements.items()},
                                     plan.fused)
        for name in graph.topo_order:
            p = plan.placements[name]
            self.calls[name] = CallLayout(name, graph.call(name).model_name, meshes[name], p.strategy, p.n_mbs,
                                          p.recompute)
        for m in self.models:  # a generation layout that training also uses cannot hold a stale copy
            self.snapshots(m)
        check_runtime_tail(plan, graph)  # what the runtime's tail migration supports (graph/streaming.py)

    def fused_partner(self, call: str) -> tuple[str, str] | None:
        """The fused pair (first, second) ``call`` belongs to (plan field 'fused'), or None."""
        return next(((a, b) for a, b in self.plan.fused if call in (a, b)), None)

    # -- models and layouts ---------------------------------------------------------------------------
    @cached_property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.calls[c].model for c in self.graph.topo_order))

    def model_config(self, model: str) -> ModelConfig | None:
        return self.graph.model_config(self.graph.calls_of_model(model)[0])

    def generation_vocab_size(self) -> int | None:
        """The smallest vocabulary of the run's models: every model reads the same token ids (None: only rules)."""
        sizes = {self.model_config(m).vocab_size for m in self.models if not self.is_rule(m)}
        return min(sizes) if sizes else None

    def is_rule(self, model: str) -> bool:
        return self.model_config(model) is None

    def is_trained(self, model: str) -> bool:
        return any(self.graph.call(c).is_train for c in self.graph.calls_of_model(model))

    def train_call(self, model: str) -> str | None:
        trains = [c for c in self.chain_calls(model) if self.graph.call(c).is_train]
        return trains[-1] if trains else None

    def chain_calls(self, model: str) -> tuple[str, ...]:
        return tuple(c for c in self.graph.topo_order if self.calls[c].model == model)

    def is_stale(self, call: str) -> bool:
        """A generation call that runs ahead of training (only with staleness > 0)."""
        return self.staleness > 0 and call in self.graph.stale_calls

    def fresh_calls(self, model: str) -> tuple[str, ...]:
        """The model's chain without its stale calls: the calls that read the current parameter version."""
        return tuple(c for c in self.chain_calls(model) if not self.is_stale(c))

    def stale_calls_of(self, model: str) -> tuple[str, ...]:
        return tuple(c for c in self.chain_calls(model) if self.is_stale(c))

    def snapshots(self, model: str) -> tuple[Realloc, ...]:
        """One copy from home per layout of the model's stale calls, unless that layout is home itself."""
        stale = self.stale_calls_of(model)
        if not stale:
            return ()
        home = self.home_call(model)
        fresh_keys = {self.calls[c].key: c for c in self.fresh_calls(model)}
        out: dict[LayoutKey, Realloc] = {}
        for c in stale:
            key = self.calls[c].key
            if key == self.calls[home].key or key in out:
                continue
            if key in fresh_keys:
                raise ValueError(f"staleness {self.staleness}: generation call {c!r} shares its layout with call "
                                 f"{fresh_keys[key]!r}, which reads the current parameters of {model!r}; give "
                                 f"{c!r} the layout of the train step or one of its own")
            out[key] = Realloc(model, home, c, (), wraps=True, snapshot=True)
        return tuple(out.values())

    def snapshot_of(self, call: str) -> Realloc | None:
        """The snapshot a stale call reads (None: it reads home in place)."""
        key = self.calls[call].key
        return next((r for r in self.snapshots(self.calls[call].model) if self.calls[r.dst_call].key == key), None)

    def segments(self, model: str) -> tuple[Segment, ...]:
        out: list[Segment] = []
        for c in self.fresh_calls(model):
            key = self.calls[c].key
            if out and out[-1].key == key:
                out[-1] = Segment(model, key, out[-1].calls + (c,))
            else:
                out.append(Segment(model, key, (c,)))
        return tuple(out)

    def home_call(self, model: str) -> str:
        """A call whose layout is the model's home (see the module docstring)."""
        return self.segments(model)[-1].calls[-1]

    def reallocs(self, model: str) -> tuple[Realloc, ...]:
        """Reallocation nodes of one iteration, in chain order; the first may wrap from the previous one."""
        if self.is_rule(model):
            return ()
        segs = self.segments(model)
        out = []
        if len(segs) > 1 and segs[-1].key != segs[0].key:
            out.append(Realloc(model, segs[-1].calls[-1], segs[0].calls[0], segs[-1].calls, wraps=True))
        for prev, cur in zip(segs, segs[1:]):
            out.append(Realloc(model, prev.calls[-1], cur.calls[0], prev.calls, wraps=False))
        return tuple(out) + self.snapshots(model)

    def realloc_movers(self, r: Realloc) -> frozenset[int]:
        """The ranks of reallocation ``r`` that send or receive bytes. The others only copy shards in place or
        release their source: no rank waits for them (master_schedule._wait_realloc)."""
        if r not in self.movers:  # the plan is the same every iteration
            plan = self.realloc_plan(r)
            self.movers[r] = frozenset(d for d, b in (*plan.sent_bytes.items(), *plan.received_bytes.items()) if b)
        return self.movers[r]

    def dtype_of(self, call: str) -> tuple[str, int]:
        """The torch dtype name and bytes per element of the parameters in ``call``'s layout: its pool's dtype."""
        pool = self.graph.spec.cluster.pool_cluster(self.calls[call].mesh.pool)
        return PARAM_DTYPES[pool.hardware.dtype]

    def layouts_on(self, rank: int) -> dict[LayoutKey, CallLayout]:
        """Distinct model layouts that include ``rank``, each named by its first call."""
        out: dict[LayoutKey, CallLayout] = {}
        for c in self.graph.topo_order:
            cl = self.calls[c]
            if rank in cl.ranks and not self.is_rule(cl.model):
                out.setdefault(cl.key, cl)
        return out

    def all_layouts(self) -> dict[LayoutKey, CallLayout]:
        out: dict[LayoutKey, CallLayout] = {}
        for c in self.graph.topo_order:
            cl = self.calls[c]
            if not self.is_rule(cl.model):
                out.setdefault(cl.key, cl)
        return out

    def realloc_plan(self, r: Realloc) -> TransferPlan:
        cfg = self.model_config(r.model)
        assert cfg is not None
        # bytes travel in the sender's dtype; a receiver of another dtype casts them (pool_dtypes.py)
        return plan_param_realloc(cfg, self.calls[r.src_call].layout, self.calls[r.dst_call].layout,
                                  bytes_per_element=self.dtype_of(r.src_call)[1])

    # -- data ----------------------------------------------------------------------------------------
    def producer(self, call: str, ranges: tuple[tuple[int, int], ...] | None = None) -> DataLayout:
        """Where a call's outputs live: generation leaves them on every stage, a forward pass on the last;
        ``ranges``: its dp ranks' shares of the batch when not the even split (token-balanced)."""
        cl = self.calls[call]
        s = cl.strategy
        gen = self.graph.call(call).interface_type is InterfaceType.GENERATE
        stages = tuple(range(s.pp)) if gen else (s.pp - 1,)
        return DataLayout(cl.mesh, s, stages, ranges)

    def consumer(self, call: str, ranges: tuple[tuple[int, int], ...] | None = None) -> DataLayout:
        """Every stage of a consumer gets its dp rank's inputs: the first stage embeds the tokens, the last
        computes losses from the other keys, and the pipeline derives positions from the tokens on all."""
        cl = self.calls[call]
        return DataLayout(cl.mesh, cl.strategy, tuple(range(cl.strategy.pp)), ranges)

    def producer_of(self, key: str) -> str | None:
        for r in self.graph.calls:
            if key in r.output_data:
                return r.name
        return None  # a dataset key

    def data_plan(self, key: str, consumer: str, seq_bytes: int,
                  cached: dict[int, list[tuple[str, int, int]]] | None = None,
                  src_ranges: tuple[tuple[int, int], ...] | None = None,
                  dst_ranges: tuple[tuple[int, int], ...] | None = None) -> TransferPlan:
        src = self.producer_of(key)
        assert src is not None, key
        return plan_data_transfer({key: [seq_bytes] * self.batch_size}, self.producer(src, src_ranges),
                                  self.consumer(consumer, dst_ranges), cached=cached)

    # -- process groups --------------------------------------------------------------------------------
    def startup_rank_sets(self) -> list[tuple[int, ...]]:
        """Broadcast groups of every reallocation and of every data transfer with a cold cache, sorted.

        Model groups come separately (``ProcessGroupCache.ensure_layouts``). Data plans with a warm
        cache can need other groups; the master asks all workers to create those when they first occur.
        """
        sets: set[tuple[int, ...]] = set()
        for m in self.models:
            for r in self.reallocs(m):
                sets.update(self.realloc_plan(r).groups)
        for r in self.graph.calls:
            for key in r.input_data:
                if self.producer_of(key) is not None:
                    sets.update(self.data_plan(key, r.name, 1).groups)
        return sorted(sets)
