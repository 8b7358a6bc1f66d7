"""A worker's local data: per (key, iteration), the rows of sequence ranges it produced or received.

Rows arrive in pieces (one per producer dp rank or transfer), so a key is a list of
``[lo, hi)`` chunks; a read concatenates the chunks covering the range it asks for. This is
also the paper's local data cache (realhf.txt §6): whatever a device holds is never sent to it
again, because the master plans transfers with the ranges each device already has.
"""

from __future__ import annotations

from typing import Sequence

import torch

from realloc.runtime.transfer.row_layout import index_runs, row_bytes  # noqa: F401 (the master's, torch-free)
from realloc.runtime.wire.protocol import TensorMeta

Rows = dict[str, torch.Tensor]  # tensor name -> [n, ...]


class DataStore:
    def __init__(self) -> None:
        self._chunks: dict[tuple[str, int], list[tuple[int, int, Rows]]] = {}

    def put(self, key: str, iteration: int, lo: int, hi: int, rows: Rows) -> None:
        for name, t in rows.items():
            if t.shape[0] != hi - lo:
                raise ValueError(f"data {key!r}/{name}: {t.shape[0]} rows for sequences [{lo}, {hi})")
        chunks = self._chunks.setdefault((key, iteration), [])
        chunks.append((lo, hi, {n: t.detach().cpu() for n, t in rows.items()}))
        chunks.sort(key=lambda c: (c[0], -c[1]))

    def has(self, key: str, iteration: int, lo: int, hi: int) -> bool:
        try:
            self._cover(key, iteration, lo, hi)
        except KeyError:
            return False
        return True

    def _cover(self, key: str, iteration: int, lo: int, hi: int) -> list[tuple[int, int, int, Rows]]:
        """Pieces (chunk lo, from, to, rows) that tile [lo, hi), greedily from the left."""
        pieces, cur = [], lo
        chunks = self._chunks.get((key, iteration), [])
        while cur < hi:
            best = max((c for c in chunks if c[0] <= cur < c[1]), key=lambda c: c[1], default=None)
            if best is None:
                raise KeyError(f"data {key!r} of iteration {iteration}: sequences [{cur}, {hi}) are not on this "
                               f"device")
            to = min(hi, best[1])
            pieces.append((best[0], cur, to, best[2]))
            cur = to
        return pieces

    def get(self, key: str, iteration: int, lo: int, hi: int) -> Rows:
        pieces = self._cover(key, iteration, lo, hi)
        names = list(pieces[0][3])
        if len(pieces) == 1:
            base, a, b, rows = pieces[0]
            return {n: rows[n][a - base:b - base] for n in names}
        return {n: torch.cat([rows[n][a - base:b - base] for base, a, b, rows in pieces]) for n in names}

    def get_rows(self, key: str, iteration: int, ids: Sequence[int]) -> Rows:
        """Rows ``ids`` (ascending sequence indices, a range or any list) in that order."""
        runs = index_runs(ids)
        if len(runs) == 1:
            return self.get(key, iteration, *runs[0])
        parts = [self.get(key, iteration, lo, hi) for lo, hi in runs]
        return {n: torch.cat([p[n] for p in parts]) for n in parts[0]} if parts else {}

    def put_rows(self, key: str, iteration: int, ids: Sequence[int], rows: Rows) -> None:
        """Store rows ``ids`` (ascending), one chunk per run of consecutive sequences (no rows: an empty chunk, so
        the key's tensors are known here, as ``put`` of an empty range keeps them)."""
        if not ids:
            self.put(key, iteration, 0, 0, rows)
        at = 0
        for lo, hi in index_runs(ids):
            self.put(key, iteration, lo, hi, {n: t[at:at + hi - lo] for n, t in rows.items()})
            at += hi - lo

    def meta(self, key: str, iteration: int) -> list[TensorMeta]:
        _, _, rows = self._chunks[(key, iteration)][0]
        return [TensorMeta(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape[1:]))
                for n, t in sorted(rows.items())]

    def release(self, before_iteration: int) -> None:
        for k in [k for k in self._chunks if k[1] < before_iteration]:
            del self._chunks[k]

    def keys(self) -> list[tuple[str, int]]:
        return sorted(self._chunks)


def pack_rows(rows: Rows, metas: list[TensorMeta]) -> torch.Tensor:
    """Rows as one flat uint8 buffer: per sequence, every tensor's bytes in ``metas`` order."""
    n = next(iter(rows.values())).shape[0]
    parts = []
    for m in metas:
        t = rows[m.name]
        if str(t.dtype).removeprefix("torch.") != m.dtype or list(t.shape[1:]) != m.shape:
            raise ValueError(f"data tensor {m.name!r} is {t.dtype} {list(t.shape[1:])}, expected {m.dtype} {m.shape}")
        parts.append(t.contiguous().view(torch.uint8).reshape(n, -1))
    return torch.cat(parts, dim=1).reshape(-1)


def unpack_rows(buf: torch.Tensor, metas: list[TensorMeta], n: int) -> Rows:
    table = buf.reshape(n, -1)
    out, off = {}, 0
    for m in metas:
        dtype = getattr(torch, m.dtype)
        width = row_bytes([m])
        # a copy: a single row's slice is contiguous already, but may start at an offset the dtype cannot view
        out[m.name] = table[:, off:off + width].clone(memory_format=torch.contiguous_format).view(dtype).reshape(
            n, *m.shape)
        off += width
    return out


def row_tokens(seq: Rows) -> list[int]:
    """Tokens of each generated sequence (prompt and response): what token-balanced dp ranks balance
    (``graph/row_balance.py``)."""
    return (seq["prompt_lens"].long() + seq["gen_mask"].long().sum(dim=1)).tolist()
