"""Sequence packing inside one micro-batch (issue 21, item 6).

Calls hand the engine right-padded rows, each as wide as the longest sequence of the
batch, so a micro-batch whose lengths vary 1-8x spends up to half its compute on padding.
:func:`pack_layout` moves the sequences of a micro-batch into as few rows as possible,
each of capacity = the micro-batch's longest sequence (first-fit decreasing over the
lengths, ties broken by row index, so every pipeline stage derives the same packed shape
from the lengths it also knows). Positions restart at 0 for every sequence, so the rotary
angles are those of the unpacked rows, and segment ids keep the sequences of a row apart:
the stage runs on the block-diagonal causal mask of ``llama.segment_mask``. SDPA takes that
boolean mask on every device; a varlen kernel over ``cu_seqlens`` (flash-attention's, as
ReaLHF's code uses on GPUs) would replace it where the engine calls
``TokenLayout.attention_mask``, and skip the masked blocks' work.

:meth:`PackPlan.unpack` gathers per-token outputs ``[R, C, ...]`` back into the caller's
``[B, T, ...]`` (zeros at the caller's padding). It is an index gather, so gradients flow
back into the packed rows; loss functions see the caller's shapes and never the packing.
"""

from __future__ import annotations

import dataclasses

import torch

from realloc.models.batch import TokenLayout
from realloc.strategy import even_ranges


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where every token of a right-padded micro-batch ``[B, T]`` sits in its packed form ``[R, C]``."""

    layout: TokenLayout  # packed [R, C]: ids, positions restarting per sequence, segment ids (-1 = empty slot)
    index: torch.Tensor  # [B, T] long: flat index into [R * C] of each caller token (0 at the caller's padding)
    valid: torch.Tensor  # [B, T] bool: the caller's real tokens

    @property
    def caller_shape(self) -> tuple[int, int]:
        return tuple(self.index.shape)  # type: ignore[return-value]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[R, C, ...]`` -> ``[B, T, ...]``, zeros where the caller has padding; differentiable."""
        r, c = self.layout.shape
        assert tuple(packed.shape[:2]) == (r, c), (tuple(packed.shape), (r, c))
        rest = tuple(packed.shape[2:])
        out = packed.reshape(r * c, *rest).index_select(0, self.index.reshape(-1)).view(*self.caller_shape, *rest)
        keep = self.valid.view(*self.caller_shape, *([1] * len(rest)))
        # where, not a product: a -inf or nan in a dropped slot must not leak into the caller's zeros.
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, in placement order) of total length <= ``capacity``.

    Longest first, ties by index, each into the first bin it fits: deterministic, and at most
    11/9 OPT + 6/9 bins (Dósa 2007). Items of length 0 go nowhere (they have no tokens).
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"first_fit_decreasing: item {i} of length {n} exceeds the capacity {capacity}")
        for k, u in enumerate(used):
            if u + n <= capacity:
                bins[k].append(i)
                used[k] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return bins


def pack_layout(layout: TokenLayout) -> PackPlan | None:
    """The packed form of a micro-batch of right-padded rows (one sequence each), or None to run it as it is.

    None when the rows are not one right-padded sequence each (left padding, an explicit mask with holes,
    ``cu_seqlens``: the caller chose a layout) or when packing would not shrink the ``[B, T]`` token
    slots; so a micro-batch without padding runs exactly as before.
    """
    if not layout.causal_suffices:
        return None
    b, t = layout.shape
    valid = layout.segment_ids >= 0
    lengths = valid.sum(dim=1).tolist()
    capacity = max(lengths, default=0)
    if capacity == 0:
        return None
    bins = first_fit_decreasing(lengths, capacity)
    if len(bins) * capacity >= b * t:
        return None
    # Where each caller row starts in the flat [R * C] packed buffer, and its slot within its packed row.
    start = [0] * b
    slot = [0] * b
    for r, rows in enumerate(bins):
        offset = r * capacity
        for k, row in enumerate(rows):
            start[row], slot[row] = offset, k
            offset += lengths[row]
    dev = layout.input_ids.device
    cols = torch.arange(t, device=dev).view(1, t)
    index = torch.where(valid, torch.tensor(start, device=dev).view(b, 1) + cols, torch.zeros_like(cols))
    flat = index[valid]
    size = len(bins) * capacity
    ids = torch.zeros(size, dtype=layout.input_ids.dtype, device=dev)
    pos = torch.zeros(size, dtype=layout.position_ids.dtype, device=dev)
    seg = torch.full((size,), -1, dtype=layout.segment_ids.dtype, device=dev)
    ids[flat] = layout.input_ids[valid]
    pos[flat] = layout.position_ids[valid]  # 0, 1, ... per right-padded row: the unpacked rotary positions
    seg[flat] = torch.tensor(slot, dtype=seg.dtype, device=dev).view(b, 1).expand(b, t)[valid]
    shape = (len(bins), capacity)
    return PackPlan(TokenLayout(ids.view(shape), pos.view(shape), seg.view(shape)), index, valid)


def token_balanced_ranges(lengths: list[int], n_mbs: int) -> list[tuple[int, int]]:
    """Contiguous row ranges of ``n_mbs`` micro-batches with near-equal token counts (each at least one row).

    For inference only: a row's outputs do not depend on the rows beside it, so moving the boundaries changes
    no result, while packed micro-batches cost about their tokens, not their rows (pipeline stages wait for
    the slowest). Equal lengths keep ``even_ranges``' boundaries, so unpadded batches run exactly as before.
    """
    b = len(lengths)
    if n_mbs < 1 or n_mbs > b:
        raise ValueError(f"n_mbs={n_mbs} must be between 1 and the batch size {b}")
    if len(set(lengths)) <= 1:
        return list(even_ranges(b, n_mbs))
    cum = [0]
    for n in lengths:
        cum.append(cum[-1] + n)
    bounds = [0]
    for k in range(1, n_mbs):
        target = cum[-1] * k / n_mbs
        lo, hi = bounds[-1] + 1, b - (n_mbs - k)  # leave a row for this and every later micro-batch
        cut = next((i for i in range(lo, hi + 1) if cum[i] >= target), hi)
        if cut > lo and target - cum[cut - 1] < cum[cut] - target:
            cut -= 1  # the boundary before the row that crosses the target is closer to it
        bounds.append(cut)
    bounds.append(b)
    return list(zip(bounds[:-1], bounds[1:]))
