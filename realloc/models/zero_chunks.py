"""How the distributed optimizer (``zero.py``) cuts tensors into dp chunks and groups them into flat buffers.

Torch-free, so that the memory estimate (``estimator/memory.py``) and the plan search import no torch.
"""

from __future__ import annotations

from typing import Sequence

BUCKET_NUMEL = 1 << 25  # elements per flat reduce-scatter/all-gather buffer (grads.BUCKET_NUMEL's size)


def chunk_numel(numel: int, dp: int) -> int:
    """Elements of one dp rank's chunk of a tensor of ``numel`` elements (the last chunk is padded to it)."""
    return -(-numel // dp)


def chunk_range(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[lo, hi) of the flattened tensor that ``dp_rank`` steps; empty for a rank past the end of a tiny tensor."""
    c = chunk_numel(numel, dp)
    lo = min(dp_rank * c, numel)
    return lo, min(lo + c, numel)


def plan_buckets(numels: Sequence[int], dp: int, max_numel: int = BUCKET_NUMEL) -> list[list[int]]:
    """Indices of ``numels`` grouped in order into flat buffers of at most ``max_numel`` padded elements
    (dp chunks per tensor); a tensor larger than that gets a buffer of its own. The estimator uses the same
    plan for the buffers' size (``estimator/memory.py``)."""
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        padded = dp * chunk_numel(n, dp)
        if out and size + padded <= max_numel:
            out[-1].append(i)
            size += padded
        else:
            out.append([i])
            size = padded
    return out
