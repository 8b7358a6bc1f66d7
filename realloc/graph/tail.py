"""Long-tail migration of a generation call (rlhfuse.txt §4, inter-stage fusion): once no more than ``rows`` of
the call's rows are still decoding, they move to the first ``instances`` of its dp replicas (re-running their
prefill there, or moving their KV caches), the call's other devices are freed, and calls placed on the freed
devices start on the rows that have finished. ``ExecutionPlan.tail`` maps a GENERATE call to its migration;
a call without an entry runs to its end where it started (no fusion), as before the field existed.

The planner chooses ``rows`` (R_t) and ``instances`` (m); the estimator prices them, both simulators simulate
them and the runtime carries them out (docs/long-tail.md). Finished rows stream to the calls that read them
whether or not a call migrates.

``instances=0`` is streaming without migration (FlexRLHF's disaggregated placement): no row moves, every dp replica
keeps decoding its own rows, and at the split point (the step after which at most ``rows`` rows are running) the
finished rows stream to the consumers on devices outside the generation's mesh (docs/tail-semantics.md). With
``chunks=k`` (streaming only) the generation hands its finished rows on at k split points (``split_thresholds``),
the last of them the one at ``rows``: chunked streaming, issue 31 item 2."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Mapping, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

if TYPE_CHECKING:
    from realloc.graph.dataflow import DataflowGraph


def not_a_bool(cls: type, value: object) -> object:
    """A pydantic ``mode="before"`` validator of an int field: pydantic reads JSON true as 1, a typo, refused by
    name (the model's error names the field)."""
    if isinstance(value, bool):
        raise ValueError(f"a count, not true/false; got {str(value).lower()}")
    return value


def a_bool(cls: type, value: object) -> object:
    """A pydantic ``mode="before"`` validator of a bool field: pydantic reads 1, "yes" or "on" as true, a typo or a
    count in the wrong place, refused by name (numpy's bool passes as the bool it is)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"true or false, got {value!r}")


class TailMigration(BaseModel):
    """R_t and m of one generation call. ``rows`` counts rows of the whole call (all dp ranks together) at or
    below which the tail migrates; ``instances`` is how many of its dp replicas (the lowest dp ranks) keep
    decoding the tail; 0 means none move (stream only: the split point hands the finished rows on, every replica
    keeps decoding its own tail)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rows: int = Field(ge=1)
    instances: int = Field(ge=0)
    chunks: int = Field(default=1, ge=1)  # split points of a stream-only entry (``split_thresholds``)
    # stream-only: the micro-batches decode one after another, as in the plain call, so the rows of each end
    # together and the split points fall between micro-batches (FlexRLHF Fig. 4b; estimator/mb_stream_cost.py)
    micro_batches: bool = False
    # how the tail rows reach the tail replicas (a migration only): "move" their KV caches (cut at the migration
    # point, models/kv_move.py), "prefill" (re-run it over prompt + tokens so far), or "auto": what the estimator
    # prices cheaper (estimator/tail_cost.py; the search writes "prefill" where that wins, and the runtime moves
    # the caches otherwise)
    kv: Literal["auto", "move", "prefill"] = "auto"

    _not_a_bool = field_validator("rows", "instances", "chunks", mode="before")(not_a_bool)
    _a_bool = field_validator("micro_batches", mode="before")(a_bool)

    @model_serializer(mode="wrap")
    def _without_one_chunk(self, handler):  # a plan without chunks writes the JSON of before, bit for bit
        out = handler(self)
        if self.chunks == 1:
            out.pop("chunks", None)
        if not self.micro_batches:
            out.pop("micro_batches", None)
        if self.kv == "auto":
            out.pop("kv", None)
        return out

    @property
    def moves_kv(self) -> bool:
        """Whether the runtime moves the tail's KV caches (else it re-runs their prefill)."""
        return self.kv != "prefill"

    @property
    def streams_only(self) -> bool:
        return self.instances == 0


def same_tail(a: TailMigration | None, b: TailMigration | None) -> bool:
    """The same migration, however its KV caches reach the tail (a plan written before ``kv``, or by hand, finds
    the search's row)."""
    if a is None or b is None:
        return a is b
    return a.model_copy(update={"kv": "auto"}) == b.model_copy(update={"kv": "auto"})


def split_thresholds(n_rows: int, rows: int, chunks: int) -> tuple[int, ...]:
    """The running-row counts at or below which a stream-only generation of ``n_rows`` rows hands its finished rows
    on, one per chunk, descending, the last ``rows``: split point j (1..k) is the first decode step after which at
    most rows + floor((n_rows - rows) (k - j) / k) rows run, so the n_rows - rows rows before the last split point
    come in k chunks of about equal expected size. One step may pass several thresholds: the chunks between are
    empty."""
    return tuple(rows + (n_rows - rows) * (chunks - j) // chunks for j in range(1, chunks + 1))


class Placed(Protocol):
    """What the check reads of a call's placement (graph.plan.CallPlacement has it)."""

    dp: int


def tail_error(graph: "DataflowGraph", placements: Mapping[str, Placed], call: str,
               tail: TailMigration) -> str | None:
    """Why ``call`` cannot migrate its tail as ``tail`` says under ``placements``, or None if it can."""
    names = graph.spec.call_names
    if call not in names:
        return f"call {call!r} is not in experiment {graph.spec.name!r} (calls: {', '.join(names)})"
    rpc = graph.call(call)
    if rpc.interface_type.value != "generate":
        kind = rpc.interface_type.value
        return (f"call {call!r} is {'an' if kind[0].lower() in 'aeiou' else 'a'} {kind} call; only GENERATE calls have a "
                f"tail to migrate")
    if tail.kv != "auto" and not tail.instances:
        return (f"call {call!r} has kv={tail.kv!r}, but a stream-only entry (instances=0) moves no rows; drop 'kv' "
                f"or set instances")
    if tail.micro_batches and tail.instances:
        return (f"call {call!r} has micro_batches=true, but only a stream-only entry (instances=0) hands its "
                f"micro-batches on; set instances=0 or drop micro_batches")
    dp = placements[call].dp
    if tail.instances and tail.instances >= dp:
        return (f"call {call!r} runs on {dp} dp replica(s), so its tail can move to at most {dp - 1} of them "
                f"(instances={tail.instances}); lower 'instances' (0: stream only, no migration) or drop the "
                f"call's tail entry")
    n_rows = graph.spec.n_seqs(rpc)
    if tail.rows >= n_rows:
        return (f"call {call!r} generates {n_rows} rows per iteration; the tail threshold rows={tail.rows} must be "
                f"below that (it is the count of rows still running at the migration or split point)")
    if tail.chunks > 1 and tail.instances:
        return (f"call {call!r} has chunks={tail.chunks}, but only a stream-only entry (instances=0) streams in "
                f"chunks; set instances=0 or chunks=1")
    if tail.chunks > 1 and tail.chunks > n_rows - tail.rows:
        return (f"call {call!r} has chunks={tail.chunks}, more than the {n_rows - tail.rows} rows that finish "
                f"before the last split point (rows={tail.rows} of {n_rows}); lower 'chunks'")
    return None


def check_tail(graph: "DataflowGraph", placements: Mapping[str, Placed],
               tail: Mapping[str, TailMigration]) -> None:
    """Raise one ValueError naming the first tail entry that cannot be carried out."""
    for call, t in tail.items():
        why = tail_error(graph, placements, call, t)
        if why:
            raise ValueError(f"plan field 'tail' entry {call!r}: {why}")
