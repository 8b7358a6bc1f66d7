"""ExecutionPlan: where and how every call runs. The only thing search hands to runtime."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from realloc.atomic_file import write_text_atomically
from realloc.cluster import DeviceMesh
from realloc.graph.fused import check_fused
from realloc.graph.tail import TailMigration, a_bool, check_tail, not_a_bool
from realloc.strategy import ParallelStrategy, strategy_error

if TYPE_CHECKING:
    from realloc.graph.dataflow import DataflowGraph

PLAN_FORMAT_VERSION = 1


class CallPlacement(BaseModel):
    """One call's device mesh, 3D-parallel strategy and micro-batch count; for a TRAIN_STEP call also
    whether it recomputes activations in the backward (``ParallelModel.train_step(recompute=...)``).
    Plans written before ``recompute`` existed read as no recomputation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mesh: str
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    n_mbs: int = Field(default=1, ge=1)
    recompute: bool = False

    _not_a_bool = field_validator("dp", "tp", "pp", "n_mbs", mode="before")(not_a_bool)
    _a_bool = field_validator("recompute", mode="before")(a_bool)

    @property
    def strategy(self) -> ParallelStrategy:
        return ParallelStrategy(self.dp, self.tp, self.pp)

    @classmethod
    def of(cls, mesh: DeviceMesh | str, strategy: ParallelStrategy, n_mbs: int = 1,
           recompute: bool = False) -> "CallPlacement":
        return cls(mesh=str(mesh), dp=strategy.dp, tp=strategy.tp, pp=strategy.pp, n_mbs=n_mbs, recompute=recompute)


# The search's estimates: a saved plan stamps them with its layout_digest (ESTIMATES_FOR), and a file whose layout
# was edited afterwards loads without them, its source EDITED (they would describe another plan).
ESTIMATE_FIELDS = ("estimated_time", "estimated_peak_memory", "call_times", "call_memory")
ESTIMATES_FOR = "estimates_for"
EDITED = "edited after its search"
TIGHT_MEMORY = 0.95  # a plan using this share of usable memory or more gets a warning


class ExecutionPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = PLAN_FORMAT_VERSION
    experiment: str
    graph_digest: str
    nodelist: str
    n_devices_per_node: int
    device: str
    placements: dict[str, CallPlacement]
    # model_name -> keep a frozen model's parameters in host memory between its calls
    offload: dict[str, bool] = Field(default_factory=dict)
    source: str = "manual"
    # Bounded staleness eta (asynchronous RL): generation of iteration t uses the parameters after the train
    # step of iteration t - 1 - eta (docs/async-rl.md). 0: synchronous.
    staleness: int = Field(default=0, ge=0)
    estimated_time: float | None = None  # seconds per iteration, steady state
    estimated_peak_memory: int | None = None  # bytes, the most loaded device
    call_times: dict[str, float] = Field(default_factory=dict)  # seconds, standalone estimate per call
    call_memory: dict[str, int] = Field(default_factory=dict)  # bytes per device, peak while the call runs
    # Fused train pairs (first, second): one pipeline schedule for both, the second's stages in reverse order
    # (rlhfuse.txt §5; graph/fused.py, docs/fused-training.md). Plans without the field fuse nothing.
    fused: tuple[tuple[str, str], ...] = ()
    # Long-tail migration per GENERATE call (rlhfuse.txt §4; graph/tail.py, docs/long-tail.md): R_t rows and m dp
    # replicas. Plans without the field migrate nothing.
    tail: dict[str, TailMigration] = Field(default_factory=dict)

    _not_a_bool = field_validator("format_version", "n_devices_per_node", "staleness", mode="before")(not_a_bool)

    @field_validator("offload", mode="before")
    @classmethod
    def _offload_bools(cls, value: object) -> object:
        for k, v in value.items() if isinstance(value, Mapping) else ():
            if not isinstance(v, bool) and type(v).__name__ != "bool_":
                raise ValueError(f"model {k!r}: true or false, got {v!r}")
        return value

    @classmethod
    def by_hand(cls, graph: "DataflowGraph", placements: Mapping[str, "tuple[str, int, int, int, int] | CallPlacement"],
                *, recompute: Iterable[str] = (), offload: Mapping[str, bool] | None = None,
                source: str = "manual", staleness: int = 0,
                fused: Iterable[tuple[str, str]] = (),
                tail: Mapping[str, "TailMigration | tuple[int, int]"] | None = None) -> "ExecutionPlan":
        """A plan written in Python: call -> (mesh, dp, tp, pp, n_mbs) or a CallPlacement; ``recompute`` names
        the train calls that recompute activations; ``fused`` the train-call pairs that share one pipeline
        schedule; ``tail`` a generation call's long-tail migration, (rows, instances), (rows, 0, chunks) or a
        TailMigration. Check it with ``validate_plan`` (the runtime does)."""
        where, spec, redo = "ExecutionPlan.by_hand", graph.spec, set(recompute)
        places = {c: _shaped(where, f"the placement of call {c!r}", p, CallPlacement,
                             ("mesh", "dp", "tp", "pp", "n_mbs"), {"recompute": c in redo})
                  for c, p in placements.items()}
        tails = {c: _shaped(where, f"tail entry {c!r}", t, TailMigration,
                            ("rows", "instances", "chunks") if isinstance(t, (tuple, list)) and len(t) == 3
                            else ("rows", "instances"), {})
                 for c, t in (tail or {}).items()}
        pairs = tuple(fused)
        for pair in pairs:
            if isinstance(pair, str) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"{where}: each fused pair is (first call, second call), got {pair!r}")
        body = dict(experiment=spec.name, graph_digest=graph.digest, nodelist=spec.cluster.nodelist,
                    n_devices_per_node=spec.cluster.n_devices_per_node, device=spec.cluster.device,
                    placements=places, offload=dict(offload or {}), source=source, staleness=staleness,
                    fused=tuple(tuple(p) for p in pairs), tail=tails)
        try:
            return cls.model_validate(body)
        except ValidationError as e:  # one line naming the field, as a plan file's error does
            first = e.errors()[0]
            raise ValueError(f"{where}: field {'.'.join(map(str, first['loc']))!r}: {first['msg']}") from None

    # -- serialization -------------------------------------------------------
    def layout_digest(self) -> str:
        """A digest of what the plan runs (placements, offload, staleness, fused pairs, tails, cluster), not of
        its estimates: a saved plan's estimates carry it, so a file edited after its search is told apart."""
        body = self.model_dump(mode="json", exclude={"format_version", "source", *ESTIMATE_FIELDS})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        text = self.model_dump_json(indent=2)
        if not any(getattr(self, f) for f in ESTIMATE_FIELDS):
            return text
        return json.dumps({**json.loads(text), ESTIMATES_FOR: self.layout_digest()}, indent=2)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "ExecutionPlan":
        stamp = _estimates_stamp(text)
        if stamp is not None:  # not a field: what the estimates were made for
            text = json.dumps({k: v for k, v in json.loads(text).items() if k != ESTIMATES_FOR})
        plan = cls._validated(text, where)
        if stamp is not None and stamp != plan.layout_digest():  # edited after the search: not its estimates
            plan = plan.model_copy(update={**{f: cls.model_fields[f].get_default(call_default_factory=True)
                                               for f in ESTIMATE_FIELDS}, "source": EDITED})
        return plan

    def edited_note(self) -> str:
        """What ``realloc run`` and ``show`` say of a plan file edited after its search ('' for any other)."""
        return (f" ({EDITED}: its estimates, made for the plan before the edit, were dropped; `realloc trace` "
                f"prices the plan that ran)" if self.source == EDITED else "")

    @classmethod
    def _validated(cls, text: str, where: str) -> "ExecutionPlan":
        try:
            plan = cls.model_validate_json(text)
        except ValidationError as e:
            first = e.errors()[0]
            if first["type"] == "json_invalid":
                raise ValueError(f"{where}: not a plan file ({first['msg']}); write it with `realloc search --out` "
                                 f"or as ExecutionPlan JSON (docs/search.md)") from None
            loc = ".".join(map(str, first["loc"]))
            raise ValueError(f"{where}: field {loc!r}: {first['msg']}") from None
        if plan.format_version != PLAN_FORMAT_VERSION:
            raise ValueError(f"{where}: plan format version {plan.format_version} is not supported "
                             f"(this realloc reads version {PLAN_FORMAT_VERSION}); search again to regenerate it")
        return plan

    def save(self, path: str | Path) -> None:
        write_text_atomically(Path(path), self.to_json())  # a crash or a peer's save never leaves half a plan

    @classmethod
    def load(cls, path: str | Path) -> "ExecutionPlan":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"plan file {str(path)!r} does not exist")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a plan file (not UTF-8 text); write it with `realloc search --out`") from None
        return cls.from_json(text, where=str(path))

    # -- presentation --------------------------------------------------------
    def memory_warning(self, usable: int) -> str | None:
        """A warning when the estimated peak is within ``TIGHT_MEMORY`` of the devices' usable memory (``usable``,
        bytes): the estimate counts tensors only (Table 2), so a plan at 100% has no room for the allocator's
        fragmentation or a longer-than-average batch; None when there is room or no estimate."""
        peak = self.estimated_peak_memory
        if peak is None or peak < TIGHT_MEMORY * usable:
            return None
        return (f"warning: this plan's estimated peak memory is {peak / 2**30:.2f} of {usable / 2**30:.2f} GiB usable "
                f"per device ({peak / usable:.0%}): no margin for allocator fragmentation or estimate error; if the run "
                f"runs out of memory, lower usable_memory_fraction of the device's profiles/hardware JSON (or "
                f"device_memory in @auto) so that the search keeps a margin")

    def table(self, order: tuple[str, ...] | None = None) -> str:
        names = order or tuple(self.placements)
        cw = max(len("call"), *map(len, names)) + 2
        mw = max(len("mesh"), *(len(self.placements[n].mesh) for n in names)) + 2
        header = (f"{'call':<{cw}}{'mesh':<{mw}}{'dp':>4}{'tp':>4}{'pp':>4}{'mbs':>5}{'recomp':>8}{'est. s':>10}"
                  f"{'mem GiB':>10}")
        rows = [header, "-" * len(header)]
        for n in names:
            p = self.placements[n]
            t = self.call_times.get(n)
            m = self.call_memory.get(n)
            rows.append(f"{n:<{cw}}{p.mesh:<{mw}}{p.dp:>4}{p.tp:>4}{p.pp:>4}{p.n_mbs:>5}{'yes' if p.recompute else '-':>8}"
                        f"{'' if t is None else f'{t:.3f}':>10}{'' if m is None else f'{m / 2**30:.2f}':>10}")
        for a, b in self.fused:
            rows.append(f"fused: {a} + {b} (one pipeline schedule; {b}'s stages in reverse order)")
        for c, t in self.tail.items():
            if t.micro_batches:  # graph/tail.py: each micro-batch handed on as it ends (FlexRLHF Fig. 4b)
                pp = self.placements[c].pp  # at pp > 1 waves of pp micro-batches (models/stream_decode.py)
                unit = "micro-batches" if pp == 1 else f"waves of {pp} micro-batches"
                rows.append(f"tail: {c} hands each of its {t.chunks + 1} {unit} to the next calls as it ends "
                            f"({unit.split()[0]} one after another, no migration)")
                continue
            if t.streams_only:  # graph/tail.py: no migration, the finished rows stream to the next calls
                rows.append(f"tail: {c} streams its finished rows to the next calls once at most {t.rows} are "
                            f"running (no migration)" + (f", in {t.chunks} chunks" if t.chunks > 1 else ""))
                continue
            how = {"auto": "", "move": ", with their KV caches", "prefill": ", re-running their prefill"}[t.kv]
            rows.append(f"tail: {c} moves its last {t.rows} running rows to {t.instances} dp replica(s){how}; "
                        f"the freed devices start the next calls")
        if self.staleness:
            rows.append(f"staleness: generation runs up to {self.staleness} train step(s) ahead")
        if self.estimated_time is not None:
            rows.append(f"estimated time per iteration: {self.estimated_time:.3f} s")
        return "\n".join(rows)


def _estimates_stamp(text: str) -> str | None:
    """The ``estimates_for`` digest a saved plan file carries (None: none, or not a JSON object)."""
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    stamp = raw.get(ESTIMATES_FOR) if isinstance(raw, dict) else None
    return None if stamp is None else str(stamp)  # a hand-written non-string matches no digest


def _shaped(where: str, what: str, value: object, model: type[BaseModel], fields: tuple[str, ...],
            extra: dict[str, object]) -> object:
    """``value`` as ``model`` takes it: the model itself, a dict of its fields, or a tuple of ``fields``."""
    if isinstance(value, model):
        return value
    if isinstance(value, Mapping):
        return {**extra, **value}
    if isinstance(value, (tuple, list)) and len(value) == len(fields):
        return {**dict(zip(fields, value)), **extra}
    raise ValueError(f"{where}: {what} must be ({', '.join(fields)}), a dict of those or a {model.__name__}, "
                     f"got {value!r}")


def validate_plan(plan: ExecutionPlan, graph: "DataflowGraph") -> dict[str, DeviceMesh]:
    """Check that ``plan`` fits ``graph`` and its cluster; return each call's parsed mesh."""
    spec, cluster = graph.spec, graph.spec.cluster
    if (plan.nodelist, plan.n_devices_per_node) != (cluster.nodelist, cluster.n_devices_per_node):
        raise ValueError(f"plan is for cluster {plan.nodelist!r} x {plan.n_devices_per_node}, but experiment "
                         f"{spec.name!r} runs on {cluster.nodelist!r} x {cluster.n_devices_per_node}")
    if plan.device != cluster.device:  # its memory check and prices were for other devices
        raise ValueError(f"plan field 'device': the plan was made for device {plan.device!r}, but experiment "
                         f"{spec.name!r} runs on {cluster.device!r}; search again for this cluster (realloc search), "
                         f"or set the plan's device to {cluster.device!r} if the plan is meant to carry over")
    unknown = sorted(set(plan.placements) - set(spec.call_names))
    if unknown:
        raise ValueError(f"plan places call {unknown[0]!r}, which experiment {spec.name!r} does not have "
                         f"(calls: {', '.join(spec.call_names)})")
    missing = [n for n in spec.call_names if n not in plan.placements]
    if missing:
        raise ValueError(f"plan has no placement for call {missing[0]!r}")
    if plan.graph_digest != graph.digest:
        which = (f"a different version of experiment {spec.name!r}" if plan.experiment == spec.name else
                 f"experiment {plan.experiment!r}, not {spec.name!r}")  # a plan file of another experiment
        raise ValueError(f"plan was made for {which} (graph digest {plan.graph_digest} != {graph.digest}); search "
                         f"again")
    if plan.staleness > spec.max_staleness:
        raise ValueError(f"plan has staleness {plan.staleness}, but experiment {spec.name!r} allows at most "
                         f"{spec.max_staleness}; set @auto(max_staleness={plan.staleness}) (or --set "
                         f"max_staleness={plan.staleness}), or use a plan of staleness <= {spec.max_staleness}")
    why = graph.staleness_error(plan.staleness)
    if why:
        raise ValueError(f"plan: {why}")
    for model, on in plan.offload.items():
        if model not in graph.model_types:
            raise ValueError(f"plan offloads model {model!r}, which the experiment does not have")
        if on and any(graph.call(c).is_train for c in graph.calls_of_model(model)):
            raise ValueError(f"plan offloads model {model!r}, but it is trained; only frozen models can be "
                             f"offloaded between calls (its optimizer state never moves)")
    meshes: dict[str, DeviceMesh] = {}
    for name in spec.call_names:
        p = plan.placements[name]
        try:
            mesh = cluster.mesh(p.mesh)
        except ValueError as e:
            raise ValueError(f"call {name!r}: {e}") from None
        s = p.strategy
        if s.world_size != mesh.size:
            raise ValueError(f"call {name!r}: dp*tp*pp = {s.dp}*{s.tp}*{s.pp} = {s.world_size} but mesh {p.mesh!r} "
                             f"has {mesh.size} devices")
        check_placement(graph, name, mesh, s, p.n_mbs, p.recompute)
        meshes[name] = mesh
    check_fused(graph, plan.placements, plan.fused)
    check_tail(graph, plan.placements, plan.tail)
    return meshes


def check_placement(graph: "DataflowGraph", name: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                    recompute: bool = False) -> None:
    """Raise ValueError if call ``name`` cannot run with ``strategy`` and ``n_mbs`` micro-batches on ``mesh`` (whose
    size must already equal the strategy's): what the planner, the runtime and the estimator's API all refuse."""
    if n_mbs < 1:
        raise ValueError(f"call {name!r}: n_mbs must be at least 1, got {n_mbs}")
    cfg = graph.model_config(name)
    if cfg is not None:
        why = strategy_error(cfg, strategy, mesh.n_devs)
        if why:
            raise ValueError(f"call {name!r}: {why}")
    elif strategy.tp != 1 or strategy.pp != 1:
        # A parameter-free rule function has nothing to shard: each device scores its own sequences.
        raise ValueError(f"call {name!r} runs a rule function, which is data-parallel only; give it tp=1, pp=1 "
                         f"and dp={mesh.size} (the mesh's devices), not tp={strategy.tp}, pp={strategy.pp}")
    if recompute and not graph.call(name).is_train:
        raise ValueError(f"call {name!r}: recompute applies to TRAIN_STEP calls only (activations are kept for "
                         f"a backward); remove 'recompute' from its placement")
    why = graph.dp_error(strategy.dp)
    if why:
        raise ValueError(f"call {name!r}: {why}")
    n_seqs = graph.steps_n_seqs(name)
    if n_seqs % (strategy.dp * n_mbs):
        raise ValueError(f"call {name!r}: {n_seqs} sequences per step cannot be split over dp={strategy.dp} into "
                         f"n_mbs={n_mbs} equal micro-batches")
