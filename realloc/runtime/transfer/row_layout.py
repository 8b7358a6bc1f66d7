"""The row arithmetic of data transfers that the master plans without torch: runs of row indices and the bytes
of one row (``data_store.py`` holds and packs the rows themselves, in the workers)."""

from __future__ import annotations

from typing import Sequence

from realloc.runtime.wire.protocol import TensorMeta

# Bytes per element of the dtypes a call's outputs use (checked against torch in tests/test_startup_paths.py).
ELEMENT_SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                 "int8": 1, "uint8": 1, "bool": 1}


def index_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending sequence indices as runs [lo, hi) of consecutive ones."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            assert not runs or i > runs[-1][1], "row lists are ascending"
            runs.append([i, i + 1])
    return [(lo, hi) for lo, hi in runs]


def row_bytes(metas: list[TensorMeta]) -> int:
    total = 0
    for m in metas:
        n = 1
        for d in m.shape:
            n *= d
        total += n * element_size(m.dtype)
    return total


def element_size(dtype: str) -> int:
    """Bytes per element of a torch dtype named without its ``torch.`` prefix (``TensorMeta.dtype``)."""
    if dtype in ELEMENT_SIZES:
        return ELEMENT_SIZES[dtype]
    import torch  # a rarer dtype: ask torch (a worker has it loaded anyway)

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()
