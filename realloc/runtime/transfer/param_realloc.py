"""Execute a transfer plan with torch.distributed: parameter reallocation (and data transfer).

The plan (``transfer_plan.py``) says who sends which slice to whom; this module moves
the bytes. Every process of the world runs :meth:`Reallocator.reallocate` with the same
plan; each does only its own part (sends, receives, local copies).

Communication choice (measured with ``benchmarks/bench_realloc.py``):
- a transfer with ONE destination is a point-to-point ``isend``/``irecv`` on the default
  group: no process group to create, and on gloo it runs at the speed of a broadcast
  (2.6 GB/s both on 2 processes here);
- a transfer with several destinations is a ``broadcast`` on the group (source + its
  destinations): NCCL's pipelined broadcast injects the payload once instead of once per
  destination; on CPU gloo one broadcast and concurrent sends to 3 destinations measured
  within noise of each other (time ratio 0.9-1.3 over runs).
  ``torch.distributed.new_group`` is collective over the whole world, so
  :meth:`Reallocator.prepare` creates the groups of every plan up front, on every process,
  in the plan's sorted order, through the shared ``ProcessGroupCache`` (one per process).

Messages. Small pieces a source sends to the same destinations are packed into one flat
buffer of at most ``bucket_bytes`` (few messages instead of one per norm weight); a piece
of at least ``direct_bytes`` goes alone, zero-copy on each side where it is a contiguous
region of the shard (e.g. a row block), and otherwise packed/unpacked while other messages
are in flight (a column block of o_proj/down_proj when tp changes). Every process derives
the same message list from the
plan alone, and issues its operations in that global order, so no two processes can wait
on each other in a cycle (this also holds for NCCL, whose operations serialize per
stream). All operations are started asynchronously and then waited, so sources with
disjoint destinations send in parallel.

Memory. Optimizer state never moves: only the tensors passed in are read. With
``drop_src=True`` the source shards' storage is released after the sends finish (a
non-trainable copy, e.g. a generation layout); without ``dst`` tensors, a destination shard
that is exactly the shard the device already holds aliases it instead of being copied.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Mapping, MutableMapping, Protocol, Sequence

import torch
import torch.distributed as dist

from realloc.graph.transfer_plan import (DataLayout, Layout, LocalCopy, Transfer, TransferPlan,
                                         shard_intervals)
from realloc.models.param_layout import param_specs
from realloc.runtime.transfer.offload import free_tensors

DEFAULT_BUCKET_BYTES = 64 * 2**20
DEFAULT_DIRECT_BYTES = 256 * 2**10


class GroupProvider(Protocol):
    """What the executor needs from the per-process group cache (``realloc.models.groups.ProcessGroupCache``)."""

    def ensure_rank_sets(self, rank_sets: Iterable[Sequence[int]]) -> int: ...

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup: ...


@dataclasses.dataclass(frozen=True)
class ReallocStats:
    """One process's view of one executed plan."""

    moved_bytes: int  # whole plan, every destination counted (see transfer_plan)
    minimal_bytes: int
    redundancy_ratio: float
    sent_bytes: int  # this process: payload it put on the wire (once per message)
    received_bytes: int  # this process
    copied_bytes: int  # this process: local copies (0 bytes moved); aliased shards are not counted
    n_messages: int  # this process: messages it took part in
    seconds: float  # this process: wall time of reallocate(), groups already created

    @property
    def gbps(self) -> float:
        """GB/s of what this process received (0 if it received nothing)."""
        return self.received_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class _Message:
    src: int
    dsts: tuple[int, ...]
    pieces: tuple[Transfer, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def build_messages(plan: TransferPlan, me: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   direct_bytes: int = DEFAULT_DIRECT_BYTES) -> list[_Message]:
    """The messages ``me`` takes part in, in global order; identical on every participant.

    A piece of at least ``direct_bytes`` is a message of its own; smaller pieces from one source
    to the same destinations share messages of up to ``bucket_bytes``.
    """
    out: list[tuple[int, _Message]] = []
    pending: dict[tuple[int, tuple[int, ...]], tuple[int, list[Transfer], int]] = {}

    def flush(key: tuple[int, tuple[int, ...]]) -> None:
        first, pieces, _ = pending.pop(key)
        out.append((first, _Message(key[0], key[1], tuple(pieces))))

    for i, t in enumerate(plan.transfers):
        if t.src != me and me not in t.dsts:
            continue
        key = (t.src, t.dsts)
        if t.nbytes >= direct_bytes:
            # Large pieces travel alone: zero-copy when contiguous on a side, and otherwise the
            # packing of one overlaps the transfer of the previous ones.
            out.append((i, _Message(t.src, t.dsts, (t,))))
            continue
        first, pieces, size = pending.get(key, (i, [], 0))
        pieces.append(t)
        pending[key] = (first, pieces, size + t.nbytes)
        if size + t.nbytes >= bucket_bytes:
            flush(key)
    for key in list(pending):
        flush(key)
    # A bucket is ordered by its first piece; the sort is stable and the same everywhere.
    return [m for _, m in sorted(out, key=lambda x: x[0])]


def _rel(t: Transfer | LocalCopy, start: int, shape: Sequence[int]) -> tuple[slice, ...]:
    """Slices of piece ``t`` inside a shard that begins at ``start`` along ``t.axis``."""
    if t.axis is None:
        return tuple(slice(None) for _ in shape)
    return tuple(slice(t.lo - start, t.hi - start) if d == t.axis else slice(None) for d in range(len(shape)))


class Reallocator:
    """Executes parameter (and data) transfer plans on this process. One per worker process.

    ``groups`` is the process's shared group cache; ``prepare`` must be called with the same
    plans in the same order on every process of the world before ``reallocate``.
    """

    def __init__(self, groups: GroupProvider, rank: int | None = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 direct_bytes: int = DEFAULT_DIRECT_BYTES) -> None:
        if bucket_bytes < 1 or direct_bytes < 1:
            raise ValueError("bucket_bytes and direct_bytes must be positive")
        self.groups = groups
        self.rank = dist.get_rank() if rank is None else rank
        self.bucket_bytes = bucket_bytes
        self.direct_bytes = direct_bytes
        # id(plan) -> (plan, this rank's messages, its local copies); plans are immutable and
        # reused every iteration, so the per-rank views are derived once. The plan is kept to
        # pin its id.
        self._views: dict[int, tuple[TransferPlan, list[_Message], list[LocalCopy]]] = {}

    def _rank_view(self, plan: TransferPlan) -> tuple[list[_Message], list[LocalCopy]]:
        hit = self._views.get(id(plan))
        if hit is None or hit[0] is not plan:
            hit = (plan, build_messages(plan, self.rank, self.bucket_bytes, self.direct_bytes),
                   [c for c in plan.local_copies if c.device == self.rank])
            self._views[id(plan)] = hit
        return hit[1], hit[2]

    def prepare(self, plans: Iterable[TransferPlan]) -> int:
        """Create every broadcast group the plans need. Collective over the world; returns how many were new."""
        sets = sorted({g for p in plans for g in p.groups})
        return self.groups.ensure_rank_sets(sets)

    # -------------------------------------------------------------------- parameters
    @torch.no_grad()  # writes into live nn.Parameters, in place
    def reallocate(self, plan: TransferPlan, src: Mapping[str, torch.Tensor] | None,
                   dst: MutableMapping[str, torch.Tensor] | None = None, *, drop_src: bool = False,
                   dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None) -> tuple[dict[str, torch.Tensor], ReallocStats]:
        """Move parameters from the plan's source layout to its destination layout.

        ``src``: this process's shards in the source layout (name -> tensor; None or empty if it
        holds none). ``dst``: the destination model's shard tensors to fill in place; if None,
        they are allocated (``dtype``/``device`` default to the source tensors'), and a shard
        identical to the one held aliases it. Returns this process's destination shards (name ->
        tensor; empty if it is not in the destination layout) and the stats.
        """
        if plan.kind != "param" or plan.model is None:
            raise ValueError("reallocate() needs a parameter plan from plan_param_realloc(); use transfer_data() "
                             "for data plans")
        me, cfg = self.rank, plan.model
        assert isinstance(plan.src, Layout) and isinstance(plan.dst, Layout)
        t0 = time.perf_counter()
        src = dict(src or {})
        mine_src = shard_intervals(cfg, plan.src, me)
        mine_dst = shard_intervals(cfg, plan.dst, me)
        missing = sorted(set(mine_src) - set(src))
        if missing:
            raise ValueError(f"reallocate on rank {me}: the source layout {plan.src} puts {missing[0]!r} (and "
                             f"{len(missing) - 1} more) here, but it is not among the given source tensors")
        if mine_src and (dtype is None or device is None):
            any_t = next(iter(src[n] for n in mine_src))
            dtype, device = dtype or any_t.dtype, device or any_t.device
        bpe = plan.bytes_per_element
        for role, tensors, mine, tp in (("source", src, mine_src, plan.src.strategy.tp),
                                        ("destination", dst or {}, mine_dst, plan.dst.strategy.tp)):
            for name, (spec, _, _) in mine.items():
                t = tensors.get(name)
                if t is not None and (tuple(t.shape) != spec.shard_shape(tp) or t.element_size() != bpe):
                    raise ValueError(f"reallocate on rank {me}: {role} tensor {name!r} is {tuple(t.shape)} "
                                     f"{t.dtype}, the plan expects shard {spec.shard_shape(tp)} with {bpe}-byte "
                                     f"elements (plan_param_realloc(bytes_per_element=...))")
        if dtype is not None and torch.empty(0, dtype=dtype).element_size() != bpe:
            raise ValueError(f"reallocate on rank {me}: dtype {dtype} does not have the plan's {bpe}-byte elements")
        aliased: set[str] = set()
        if dst is None:
            if mine_dst and dtype is None:
                raise ValueError(f"reallocate on rank {me}: this rank holds no source shards, so pass dtype= and "
                                 f"device= for the destination shards it receives")
            dst = {}
            for name, (spec, lo, hi) in mine_dst.items():
                held = mine_src.get(name)
                if held is not None and held[1:] == (lo, hi):
                    dst[name] = src[name]  # the same shard: keep it, zero copy
                    aliased.add(name)
                else:
                    dst[name] = torch.empty(spec.shard_shape(plan.dst.strategy.tp), dtype=dtype, device=device)
        else:
            lacking = sorted(set(mine_dst) - set(dst))
            if lacking:
                raise ValueError(f"reallocate on rank {me}: the destination layout {plan.dst} puts {lacking[0]!r} "
                                 f"here, but it is not among the given destination tensors")

        src_start = {n: lo for n, (_, lo, _) in mine_src.items()}
        dst_start = {n: lo for n, (_, lo, _) in mine_dst.items()}
        shape_of = {s.name: s.shape for s in param_specs(cfg)}

        def src_view(t: Transfer | LocalCopy) -> torch.Tensor:
            return src[t.name][_rel(t, src_start[t.name], shape_of[t.name])]

        def dst_view(t: Transfer | LocalCopy) -> torch.Tensor:
            return dst[t.name][_rel(t, dst_start[t.name], shape_of[t.name])]

        messages, local = self._rank_view(plan)

        def copy_local() -> int:
            n = 0
            for c in local:
                if c.name not in aliased:
                    out = dst_view(c)
                    out.copy_(src_view(c))
                    n += out.numel() * out.element_size()
            return n

        sent, received, copied = self._run(messages, src_view, dst_view, copy_local)
        if drop_src:
            keep = {id(dst[n]) for n in aliased}
            free_tensors([t for t in src.values() if id(t) not in keep])
        stats = ReallocStats(plan.moved_bytes, plan.minimal_bytes, plan.redundancy_ratio, sent, received, copied,
                             len(messages), time.perf_counter() - t0)
        return dst, stats

    # -------------------------------------------------------------------- data
    @torch.no_grad()
    def transfer_data(self, plan: TransferPlan, held: Mapping[str, torch.Tensor],
                      device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], ReallocStats]:
        """Move a batch's keys as planned by ``plan_data_transfer``.

        ``held[key]``: if this process holds ``key`` as a producer, the bytes of its dp rank's
        sequences, concatenated in order (any dtype, contiguous; sizes as in the plan's
        ``seq_bytes``). Returns, for every key this process consumes, a flat ``uint8`` tensor
        with the bytes of the sequences its dp rank needs; view it with the key's dtype/shape.
        """
        if plan.kind != "data" or plan.seq_offsets is None:
            raise ValueError("transfer_data() needs a data plan from plan_data_transfer()")
        assert isinstance(plan.src, DataLayout) and isinstance(plan.dst, DataLayout)
        me, offsets = self.rank, plan.seq_offsets
        t0 = time.perf_counter()
        p_rng, c_rng = _data_range(plan.src, me), _data_range(plan.dst, me)
        have: dict[str, tuple[torch.Tensor, int]] = {}
        if p_rng is not None:
            for key, offs in offsets.items():
                lo, hi = plan.src.row_ranges(len(offs) - 1)[p_rng]
                if key not in held:
                    raise ValueError(f"transfer_data on rank {me}: this rank produced data key {key!r} but it is "
                                     f"not among the held tensors")
                flat = held[key].reshape(-1).view(torch.uint8)
                if flat.numel() != offs[hi] - offs[lo]:
                    raise ValueError(f"transfer_data on rank {me}: key {key!r} holds {flat.numel()} bytes, the "
                                     f"plan expects {offs[hi] - offs[lo]} for sequences {lo}..{hi - 1}")
                have[key] = (flat, offs[lo])
        out: dict[str, torch.Tensor] = {}
        need_start: dict[str, int] = {}
        if c_rng is not None:
            for key, offs in offsets.items():
                lo, hi = plan.dst.row_ranges(len(offs) - 1)[c_rng]
                out[key] = torch.empty(offs[hi] - offs[lo], dtype=torch.uint8, device=device)
                need_start[key] = offs[lo]

        def src_view(t: Transfer | LocalCopy) -> torch.Tensor:
            flat, base = have[t.name]
            return flat[offsets[t.name][t.lo] - base:offsets[t.name][t.hi] - base]

        def dst_view(t: Transfer | LocalCopy) -> torch.Tensor:
            base = need_start[t.name]
            return out[t.name][offsets[t.name][t.lo] - base:offsets[t.name][t.hi] - base]

        messages, local = self._rank_view(plan)

        def copy_local() -> int:
            n = 0
            for c in local:
                dst_view(c).copy_(src_view(c))
                n += offsets[c.name][c.hi] - offsets[c.name][c.lo]
            return n

        sent, received, copied = self._run(messages, src_view, dst_view, copy_local)
        stats = ReallocStats(plan.moved_bytes, plan.minimal_bytes, plan.redundancy_ratio, sent, received, copied,
                             len(messages), time.perf_counter() - t0)
        return out, stats

    # -------------------------------------------------------------------- the engine
    def _run(self, messages: list[_Message], src_view: Callable[[Transfer], torch.Tensor],
             dst_view: Callable[[Transfer], torch.Tensor], copy_local: Callable[[], int]) -> tuple[int, int, int]:
        me = self.rank
        inflight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor] | None]] = []
        sent = received = 0
        for m in messages:
            views = [(src_view if m.src == me else dst_view)(p) for p in m.pieces]
            if len(views) == 1 and views[0].is_contiguous():
                buf, unpack = views[0], None  # zero copy: straight from / into the tensor
            else:
                buf = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device)
                unpack = None if m.src == me else views
                if m.src == me:
                    off = 0
                    for v in views:
                        buf[off:off + v.numel()].view(v.shape).copy_(v)
                        off += v.numel()
            _check_bytes(buf, m, me)
            if m.src == me:
                sent += m.nbytes
            else:
                received += m.nbytes
            if len(m.dsts) == 1:
                work = dist.isend(buf, m.dsts[0]) if m.src == me else dist.irecv(buf, m.src)
            else:
                work = dist.broadcast(buf, m.src, group=self.groups.get((m.src, *m.dsts)), async_op=True)
            inflight.append((work, buf, unpack))  # holds the buffer until the operation completes
        copied = copy_local()  # overlaps with the transfers in flight
        for work, buf, unpack in inflight:
            work.wait()
            if unpack is not None:
                off = 0
                for v in unpack:
                    v.copy_(buf[off:off + v.numel()].view(v.shape))
                    off += v.numel()
        return sent, received, copied


def _check_bytes(buf: torch.Tensor, m: _Message, me: int) -> None:
    if buf.numel() * buf.element_size() != m.nbytes:
        raise ValueError(f"rank {me}: a message of {m.pieces[0].name!r} holds {buf.numel() * buf.element_size()} "
                         f"bytes but the plan counted {m.nbytes}; make the plan with bytes_per_element = "
                         f"{buf.element_size()} (the tensors' dtype is {buf.dtype})")


def _data_range(lay: DataLayout, device: int) -> int | None:
    """The dp rank whose batch slice ``device`` holds/needs in ``lay``, or None."""
    coords = Layout(lay.mesh, lay.strategy).coords_by_device.get(device)
    if coords is None or coords[2] not in lay.stages:
        return None
    return coords[0]

