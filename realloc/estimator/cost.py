"""The estimator's public API: time and memory of calls and plans, cost of moving parameters and data.

    model = CostModel(graph)                       # profiles found under profiles/<device>/, else roofline
    model.call_cost("actor_train", mesh, ParallelStrategy(2, 8, 1), n_mbs=4)   # -> CallCost (seconds)
    model.call_cost("actor_train", mesh, ParallelStrategy(2, 8, 1), 4, recompute=True)  # activation recomputation
    model.call_memory("actor_gen", mesh, strategy, n_mbs)                      # -> CallMemory (bytes/device)
    model.realloc_cost("actor", (mesh_a, s_a), (mesh_b, s_b))                  # -> seconds, 0 if identical
    model.data_transfer_cost("actor_gen", "ref_inf", (mesh_a, s_a), (mesh_b, s_b))
    model.plan_memory(plan)                                                    # -> {device id: peak bytes}

Time (``call_time.py``) and memory (``memory.py``, whose docstring states the
memory rules the search's simulator applies) depend on a layout only through
the mesh's shape (nodes x devices per node) and the strategy, never on where the
mesh sits, so results are cached per (call, mesh shape, strategy, n_mbs, recompute):
after the first evaluation a lookup costs about a microsecond.

Layer costs come from a measured profile table of the cluster's device kind
when one matches the model's architecture (``profile_table.py``), else from
the roofline of the hardware spec (``roofline.py``). Collective costs come from
the profile's measured fits on the same device kind, else from the ClusterSpec's
bandwidths (``comm.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from realloc.calls import InterfaceType
from realloc.cluster import ClusterSpec, DeviceMesh
from realloc.envs.rollout_args import RolloutShape, rollout_shape
from realloc.estimator.call_time import ZERO, CallCost, CallTimer, LayerCosts
from realloc.estimator.comm import CommModel, GroupLinks, group_links
from realloc.estimator.hardware import Precision
from realloc.estimator.memory import (CallMemory, Workload, local_params, max_local_params, stage_call_memory,
                                      train_inflight_bytes)
from realloc.estimator.multiturn_cost import ToolHost, TurnCost, multiturn_time, turn_costs
from realloc.estimator.pool_link import pooled_plan_seconds
from realloc.estimator.profile_table import ProfileTable, ProfiledCosts, discover_profiles, sibling_dtype
from realloc.estimator.roofline import RooflineCosts
from realloc.estimator.transfer_cost import plan_seconds
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import ExecutionPlan, check_placement, validate_plan
from realloc.graph.transfer_plan import DataLayout
from realloc.graph.transfer_plan import Layout as PlanLayout
from realloc.graph.transfer_plan import plan_data_transfer, plan_param_realloc
from realloc.models.config import ModelConfig
from realloc.strategy import ParallelStrategy

# Bytes per token of one data key moved between calls: every key is priced as one
# value per token of the full sequence at 8 bytes (int64 token ids; fp32 per-token
# values are smaller), an upper bound that is negligible next to parameters.
DATA_BYTES_PER_TOKEN = 8

Layout = tuple[DeviceMesh, ParallelStrategy]

__all__ = ["CallCost", "CallMemory", "CostModel", "Layout"]


class CostModel:
    """Cost estimates for one dataflow graph on one cluster.

    ``profile`` may be one table, several (one per model architecture), or None
    to look them up under ``profiles/<device kind>/`` (``profiles_root`` overrides
    the folder); ``discover=False`` with no profile forces the roofline. Tables
    of another device kind or dtype are ignored. ``eager_decode`` models decode
    without CUDA graphs (every kernel launched from the host).
    """

    def __init__(self, graph: DataflowGraph, profile: ProfileTable | Iterable[ProfileTable] | None = None,
                 cluster: ClusterSpec | None = None, *, discover: bool = True, eager_decode: bool = False,
                 profiles_root: Path | None = None) -> None:
        self.graph = graph
        self.cluster = cluster or graph.spec.cluster
        # A cluster of pools: one model per pool prices the calls whose mesh lies there, on the pool's kind,
        # dtype, profiles and links; transfers between pools go over the pool link (pool_link.py).
        self.pool_models = tuple(CostModel(graph, profile, pool, discover=discover, eager_decode=eager_decode,
                                           profiles_root=profiles_root) for pool in self.cluster.pools)
        self.hw = self.cluster.hardware
        self.precision = self.hw.precision
        if isinstance(profile, ProfileTable):
            tables = [profile]
        elif profile is not None:
            tables = list(profile)
        elif discover and not self.pool_models:
            tables = discover_profiles(self.cluster.device, profiles_root)
        else:
            tables = []
        self.profiles = tuple(t for t in tables if t.device_kind == self.cluster.device and t.dtype == self.hw.dtype)
        # A pool computing in another of its kind's dtypes prices a model without a table of that dtype from the
        # kind's table of a sibling dtype, unscaled (profile_table.sibling_dtype), else the roofline.
        self.siblings = tuple(t for t in tables if t.device_kind == self.cluster.device
                              and sibling_dtype(self.hw, t.dtype))
        # collectives are a property of the machine, not of the model: where several tables
        # measured the same one, the newest measurement wins
        newest_last = sorted(self.profiles or self.siblings, key=lambda t: str(t.meta.get("created", "")))
        fits = [c.fit() for t in newest_last for c in t.collectives]
        self.comm = CommModel(self.cluster, fits)
        self.eager_decode = eager_decode
        self._timers: dict[str, CallTimer] = {}
        self._links: dict[tuple[int, int, ParallelStrategy], GroupLinks] = {}
        self._time_cache: dict[tuple, CallCost] = {}
        self._mem_cache: dict[tuple, tuple[CallMemory, ...]] = {}
        self._realloc_cache: dict[tuple, float] = {}
        self._data_cache: dict[tuple, float] = {}
        self._phase1_cache: dict[tuple, float] = {}  # tail_cost.phase1_cost, by the step it decodes to
        self._workloads = {r.name: self._workload(r.name) for r in graph.calls}
        self._precisions = {r.name: self._precision(r.name) for r in graph.calls}
        # multi-turn GENERATE calls: priced turn by turn (multiturn_cost.py)
        self._shapes = {r.name: rollout_shape(r.name, graph.interfaces.get(r.name), r.interface_args,
                                              graph.spec.gen_len) for r in graph.calls}

    # -- inputs ----------------------------------------------------------------
    def _workload(self, call: str) -> Workload:
        rpc = self.graph.call(call)
        spec = self.graph.spec
        n_steps = rpc.n_minibatches if rpc.interface_type is InterfaceType.TRAIN_STEP else 1
        # A DPO pair is two sequences through the model (its interface says so).
        rows = self.graph.interfaces[call].rows_per_seq if call in self.graph.interfaces else 1
        n_seqs = self.graph.steps_n_seqs(rpc)
        # A train step that trains on part of the generated batch (DAPO's dynamic sampling: its settings'
        # trained_prompts) costs that part; the calls before it process the whole generation batch.
        settings = self.graph.interfaces[call].settings(spec.config) if call in self.graph.interfaces else None
        trained = getattr(settings, "trained_prompts", None)
        if rpc.interface_type is InterfaceType.TRAIN_STEP and callable(trained):
            n_seqs = max(1, n_seqs * trained(spec.batch_size) // spec.batch_size)
        scheduled = (rpc.interface_type is InterfaceType.GENERATE
                     and getattr(settings, "length_schedule", None) is not None)  # (common.generation_config)
        return Workload(interface=rpc.interface_type, n_seqs=n_seqs * rows, n_steps=n_steps,
                        prompt_len=spec.prompt_len, gen_len=spec.gen_len, lengths=spec.response_lengths,
                        scheduled=scheduled, balanced=bool(getattr(spec.config, "balance_tokens", False)))

    def _precision(self, call: str) -> Precision:
        # A train call's settings choose its gradient buffers' dtype (TrainConfig.grad_dtype); its model's
        # static memory (memory.py rule 2) and dp traffic follow them. Other calls keep no gradients.
        if self.graph.call(call).interface_type is not InterfaceType.TRAIN_STEP or call not in self.graph.interfaces:
            return self.precision
        settings = self.graph.interfaces[call].settings(self.graph.spec.config)
        try:
            return self.precision.with_grads(settings.grad_dtype)
        except ValueError as e:
            raise ValueError(f"call {call!r}: {e}") from None

    def call_precision(self, call: str) -> Precision:
        """Bytes per element of ``call``'s parameters, gradients and optimizer state (``hardware.Precision``)."""
        self.workload(call)  # a clear error for an unknown call
        return self._precisions[call]

    def workload(self, call: str) -> Workload:
        try:
            return self._workloads[call]
        except KeyError:
            raise ValueError(f"experiment {self.graph.spec.name!r} has no call {call!r}; calls: "
                             f"{', '.join(self._workloads)}") from None

    def at(self, mesh: DeviceMesh) -> "CostModel":
        """The model that prices calls on ``mesh``: its pool's (with pools), else this one."""
        return self.pool_models[mesh.pool] if self.pool_models else self

    def layer_costs(self, cfg: ModelConfig) -> LayerCosts:
        """The cost source of one model: its measured profile if one matches, else the roofline."""
        return self._timer(cfg).costs

    def _timer(self, cfg: ModelConfig, precision: Precision | None = None) -> CallTimer:
        precision = precision or self.precision
        timer = self._timers.get((cfg.name, precision))
        if timer is None:
            roofline = RooflineCosts(cfg, self.hw, self.comm, eager_decode=self.eager_decode)
            table = next((t for t in self.profiles if t.matches(self.cluster.device, cfg, self.hw.dtype)), None)
            table = table or next((t for t in self.siblings if t.matches(self.cluster.device, cfg, t.dtype)), None)
            if table is None:
                timer = CallTimer(cfg, roofline, self.comm, self.hw, precision=precision)
            else:
                costs = ProfiledCosts(table, cfg, roofline, self.comm)
                if table.dtype != self.hw.dtype:
                    costs.source = f"profile ({table.dtype} table for {self.hw.dtype})"
                grid = sorted({c for tp in table.tp for c in costs.decode_grid(tp)})
                timer = CallTimer(cfg, costs, self.comm, self.hw, decode_grid=grid, precision=precision)
            self._timers[cfg.name, precision] = timer
        return timer

    def links(self, mesh: DeviceMesh, strategy: ParallelStrategy) -> GroupLinks:
        key = (mesh.n_nodes, mesh.n_devs, strategy)
        links = self._links.get(key)
        if links is None:
            links = self._links[key] = group_links(mesh.shape, strategy)
        return links

    # -- time --------------------------------------------------------------------
    def call_cost(self, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                  recompute: bool = False) -> CallCost:
        """Seconds ``call`` takes on ``mesh`` under ``strategy`` with ``n_mbs`` micro-batches per dp rank
        (``recompute``: a TRAIN_STEP call recomputes activations)."""
        if self.pool_models:
            return self.at(mesh).call_cost(call, mesh.in_pool, strategy, n_mbs, recompute)
        key = (call, mesh.n_nodes, mesh.n_devs, strategy, n_mbs, recompute)
        cost = self._time_cache.get(key)
        if cost is None:
            cost = self._time_cache[key] = self._call_cost(call, mesh, strategy, n_mbs, recompute)
        return cost

    def _check(self, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
               recompute: bool = False) -> None:
        """The placement checks of the planner and the runtime (``plan.check_placement``: tp inside a node and
        dividing the heads, pp within the layers, dp and n_mbs splitting the sequences), so the public API
        prices no layout that a plan could not use."""
        self.workload(call)  # a clear error for an unknown call
        if strategy.world_size != mesh.size:
            raise ValueError(f"call {call!r}: dp*tp*pp = {strategy.world_size} but mesh {mesh.name} has "
                             f"{mesh.size} devices")
        if mesh.n_devs > self.cluster.n_devices_per_node or mesh.n_nodes > self.cluster.n_nodes:
            raise ValueError(f"call {call!r}: mesh {mesh.name} ({mesh.n_nodes} x {mesh.n_devs}) does not fit cluster "
                             f"{self.cluster.nodelist!r} ({self.cluster.n_nodes} x {self.cluster.n_devices_per_node})")
        check_placement(self.graph, call, mesh, strategy, n_mbs, recompute)

    def _call_cost(self, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                   recompute: bool) -> CallCost:
        work = self.workload(call)
        self._check(call, mesh, strategy, n_mbs, recompute)
        cfg = self.graph.model_config(call)
        if cfg is None:
            # a rule function over token ids: host work only
            return CallCost.of(overhead=self.hw.call_overhead) if self.hw.call_overhead else ZERO
        timer = self._timer(cfg, self._precisions[call])
        shape = self._shapes.get(call)
        if shape is not None:
            return multiturn_time(timer, work, shape, strategy, self.links(mesh, strategy), n_mbs,
                                  self.tool_host(mesh, strategy))
        return timer.time(work, strategy, self.links(mesh, strategy), n_mbs, recompute)

    def rollout_shape(self, call: str) -> RolloutShape | None:
        """A multi-turn GENERATE call's turn profile, cap and environment threads (None for any other call)."""
        self.workload(call)  # a clear error for an unknown call
        return self._shapes[call]

    def turns(self, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int) -> list[TurnCost]:
        """A multi-turn GENERATE call's turns on one dp rank, as ``call_cost`` prices them ([] for other calls)."""
        if self.pool_models:
            return self.at(mesh).turns(call, mesh.in_pool, strategy, n_mbs)
        shape, cfg = self.rollout_shape(call), self.graph.model_config(call)
        if shape is None or cfg is None:
            return []
        self._check(call, mesh, strategy, n_mbs)
        return turn_costs(self._timer(cfg, self._precisions[call]), self.workload(call), shape, strategy,
                          self.links(mesh, strategy), n_mbs, self.tool_host(mesh, strategy))

    def tool_host(self, mesh: DeviceMesh, strategy: ParallelStrategy) -> ToolHost:
        """A multi-turn call's dp replicas on one host of ``mesh`` and the host's cores (multiturn_cost.py)."""
        return self.tool_host_of(self.cluster, mesh, strategy)

    @staticmethod
    def tool_host_of(cluster: Any, mesh: DeviceMesh, strategy: ParallelStrategy) -> ToolHost:
        replicas = min(strategy.dp, max(1, mesh.n_devs // (strategy.tp * strategy.pp)))
        return ToolHost(replicas, cluster.cores_per_device * cluster.n_devices_per_node)

    def train_passes(self, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                     recompute: bool = False) -> tuple[list[float], list[float], list[int]]:
        """A TRAIN_STEP call's per-stage seconds of one micro-batch's forward and backward, and the bytes one
        in-flight micro-batch holds per stage (``call_time.CallTimer.train_stage_passes``,
        ``memory.train_inflight_bytes``): what the fused schedule (estimator/fused_cost.py) needs."""
        self._check(call, mesh, strategy, n_mbs, recompute)
        cfg = self.graph.model_config(call)
        if cfg is None or self.graph.call(call).interface_type is not InterfaceType.TRAIN_STEP:
            raise ValueError(f"call {call!r} is not the TRAIN_STEP call of a model; it has no forward/backward passes")
        work, precision = self.workload(call), self._precisions[call]
        b = work.micro_batch(strategy.dp, n_mbs)
        # the packed rows ``call_cost`` prices the call at (``CallTimer.time``): with varying lengths, pricing
        # padded rows here made the passes, and so fusion's saving, several times too large
        rows, width = work.packed(b, strategy.dp)
        fwd, bwd = self._timer(cfg, precision).train_stage_passes(strategy, self.links(mesh, strategy), rows, width,
                                                                  recompute)
        act = [train_inflight_bytes(cfg, strategy, k, b * work.seq_len, precision, recompute)
               for k in range(strategy.pp)]
        return fwd, bwd, act

    # -- memory ------------------------------------------------------------------
    def _stage_memory(self, call: str, strategy: ParallelStrategy, n_mbs: int,
                      recompute: bool = False) -> tuple[CallMemory, ...]:
        key = (call, strategy, n_mbs, recompute)
        stages = self._mem_cache.get(key)
        if stages is None:
            cfg = self.graph.model_config(call)
            work = self.workload(call)
            if cfg is None:
                stages = tuple(CallMemory() for _ in range(strategy.pp))
            else:
                stages = tuple(stage_call_memory(cfg, work, strategy, n_mbs, k, self._precisions[call], recompute)
                               for k in range(strategy.pp))
            self._mem_cache[key] = stages
        return stages

    def call_memory(self, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                    recompute: bool = False) -> CallMemory:
        """Bytes on the most loaded device while ``call`` runs alone in this layout (its parameters included)."""
        if self.pool_models:
            return self.at(mesh).call_memory(call, mesh.in_pool, strategy, n_mbs, recompute)
        self._check(call, mesh, strategy, n_mbs, recompute)
        return max(self._stage_memory(call, strategy, n_mbs, recompute), key=lambda m: m.total)

    def plan_memory(self, plan: ExecutionPlan) -> dict[int, int]:
        """Peak bytes of every device of the cluster under ``plan`` (rules in ``memory.py``)."""
        static, per_call = self._plan_memory_parts(plan)
        return {d: static[d] + max((m.get(d, 0) for m in per_call.values()), default=0) for d in static}

    def plan_call_memory(self, plan: ExecutionPlan) -> dict[str, dict[int, int]]:
        """Bytes of each device of each call's mesh while that call runs under ``plan``: what stays on the
        device (every model's parameters, gradients and optimizer state placed there) plus the call's own
        activations and caches (and its parameter copy when it runs off its model's home layout). A GPU
        worker's per-request peak (``requests.jsonl`` "memory") measures the same thing."""
        static, per_call = self._plan_memory_parts(plan)
        return {c: {d: static[d] + b for d, b in m.items()} for c, m in per_call.items()}

    def _plan_memory_parts(self, plan: ExecutionPlan) -> tuple[dict[int, int], dict[str, dict[int, int]]]:
        meshes = validate_plan(plan, self.graph)
        graph = self.graph
        layouts = {c: (meshes[c].name, plan.placements[c].strategy) for c in graph.spec.call_names}
        static: dict[int, int] = {d: 0 for d in range(self.cluster.n_devices)}
        home: dict[str, str] = {}
        for model in graph.model_types:
            calls = [c for c in graph.topo_order if graph.call(c).model_name == model]
            trains = [c for c in calls if graph.call(c).is_train]
            home[model] = trains[0] if trains else calls[0]
        for model, hc in home.items():
            cfg = graph.model_config(hc)
            if cfg is None:
                continue
            trainable = graph.call(hc).is_train
            offloaded = bool(plan.offload.get(model)) and not trainable
            p = plan.placements[hc]
            stages = self.at(meshes[hc])._stage_memory(hc, p.strategy, p.n_mbs, p.recompute)
            for rank, dev in enumerate(meshes[hc].device_ids):
                m = stages[p.strategy.coords(rank)[2]]
                static[dev] += (0 if offloaded else m.params) + (m.optimizer if trainable else 0)
        per_call: dict[str, dict[int, int]] = {}
        for c in graph.spec.call_names:
            p = plan.placements[c]
            model = graph.call(c).model_name
            copy = layouts[c] != layouts[home[model]] or (bool(plan.offload.get(model))
                                                          and not graph.call(home[model]).is_train)
            stages = self.at(meshes[c])._stage_memory(c, p.strategy, p.n_mbs, p.recompute)
            per_call[c] = {dev: stages[p.strategy.coords(rank)[2]].dynamic
                           + (stages[p.strategy.coords(rank)[2]].params if copy else 0)
                           for rank, dev in enumerate(meshes[c].device_ids)}
        return static, per_call

    # -- moving parameters and data (realhf.txt section 6) -----------------------
    def model_config_of(self, model_name: str) -> ModelConfig | None:
        calls = self.graph.calls_of_model(model_name)
        if not calls:
            raise ValueError(f"experiment {self.graph.spec.name!r} has no model {model_name!r}; models: "
                             f"{', '.join(self.graph.model_types)}")
        return self.graph.model_config(calls[0])

    def realloc_cost(self, model_name: str, src: Layout, dst: Layout) -> float:
        """Seconds to move ``model_name``'s parameters from layout ``src`` to ``dst``; 0 if identical.

        Priced from the runtime's own broadcast plan (``transfer_plan.plan_param_realloc``).
        """
        (m1, s1), (m2, s2) = src, dst
        if m1.name == m2.name and s1 == s2:
            return 0.0
        if self.pool_models and m1.pool == m2.pool:
            return self.at(m1).realloc_cost(model_name, (m1.in_pool, s1), (m2.in_pool, s2))
        key = (model_name, m1.name, s1, m2.name, s2)
        cost = self._realloc_cache.get(key)
        if cost is None:
            cfg = self.model_config_of(model_name)
            if cfg is None:
                cost = 0.0
            else:
                # Between two pools the sender sends its own dtype (the receiver casts) and messages cross the
                # pool link (pool_link.py); inside one pool sender and receiver are this model.
                sender, receiver = self.at(m1), self.at(m2)
                # between pools each mesh keeps its own pool's node size, as in the runtime's plan (None): one
                # node size for both ends would put devices of two pools on one node and pick sources by that
                per_node = None if self.pool_models else receiver.cluster.n_devices_per_node
                bpe = sender.precision.param
                plan = plan_param_realloc(cfg, PlanLayout(m1, s1), PlanLayout(m2, s2), bytes_per_element=bpe,
                                          devices_per_node=per_node)
                # Every destination element arrives in a message or is copied from the device's own
                # source shard; the copies overlap the messages (param_realloc), so a device takes the
                # longer of the two, and the plan its slowest device. One request to the workers.
                copy_bw = receiver.hw.memory_bandwidth * receiver.hw.memory_efficiency
                copies = max((local_params(cfg, s2.tp, s2.pp, s2.coords(r)[2]) * bpe
                              - plan.received_bytes.get(dev, 0)) / copy_bw for r, dev in enumerate(m2.device_ids))
                messages = (pooled_plan_seconds(plan, self.cluster, [p.comm for p in self.pool_models])
                            if self.pool_models else plan_seconds(plan, self.comm, per_node))
                cost = max(messages, copies) + receiver.hw.call_overhead
            self._realloc_cache[key] = cost
        return cost

    def offload_cost(self, model_name: str, layout: Layout) -> float:
        """Seconds to copy the model's parameters between host memory and the devices of ``layout``
        (each device copies its own shard, all at once)."""
        if self.pool_models:
            return self.at(layout[0]).offload_cost(model_name, (layout[0].in_pool, layout[1]))
        cfg = self.model_config_of(model_name)
        if cfg is None:
            return 0.0
        s = layout[1]
        n = max_local_params(cfg, s.tp, s.pp)
        return n * self.precision.param / self.hw.host_bandwidth

    def transferred_keys(self, src_call: str, dst_call: str) -> tuple[str, ...]:
        produced = set(self.graph.call(src_call).output_data)
        return tuple(k for k in self.graph.call(dst_call).input_data if k in produced)

    def data_transfer_cost(self, src_call: str, dst_call: str, src_layout: Layout, dst_layout: Layout) -> float:
        """Seconds to move what ``dst_call`` reads from ``src_call``'s outputs between their layouts.

        Placement as the runtime does it (``realloc.runtime.control.program``): a generation leaves its
        outputs on every pipeline stage, any other call on its last stage; every stage of the
        consumer receives its dp rank's rows. One plan per key, executed one after another,
        each priced from the runtime's planner (``transfer_plan.plan_data_transfer``).
        """
        keys = self.transferred_keys(src_call, dst_call)
        if not keys:
            return 0.0
        (m1, s1), (m2, s2) = src_layout, dst_layout
        if self.pool_models and m1.pool == m2.pool:
            return self.at(m1).data_transfer_cost(src_call, dst_call, (m1.in_pool, s1), (m2.in_pool, s2))
        cache_key = (src_call, dst_call, m1.name, s1, m2.name, s2)
        cost = self._data_cache.get(cache_key)
        if cost is None:
            spec = self.graph.spec
            n = spec.n_seqs(self.graph.call(src_call))
            row = spec.seq_len * DATA_BYTES_PER_TOKEN
            generated = self.graph.call(src_call).interface_type is InterfaceType.GENERATE
            producer = DataLayout(m1, s1, stages=tuple(range(s1.pp)) if generated else (s1.pp - 1,))
            consumer = DataLayout(m2, s2, stages=tuple(range(s2.pp)))
            receiver = self.at(m2)
            per_node = None if self.pool_models else receiver.cluster.n_devices_per_node  # as in realloc_cost
            if self.pool_models:  # between two pools: messages cross the pool link (pool_link.py)
                comms = [p.comm for p in self.pool_models]
                seconds = lambda plan: pooled_plan_seconds(plan, self.cluster, comms)  # noqa: E731
            else:
                seconds = lambda plan: plan_seconds(plan, self.comm, per_node)  # noqa: E731
            cost = 0.0
            for k in keys:  # one request per key that moves anything
                plan = plan_data_transfer({k: [row] * n}, producer, consumer, devices_per_node=per_node)
                if not plan.empty:
                    cost += seconds(plan) + receiver.hw.call_overhead
            self._data_cache[cache_key] = cost
        return cost

