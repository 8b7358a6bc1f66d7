"""The worker's data store and the byte packing used for data transfers."""

import pytest
import torch

from realloc.runtime.transfer.data_store import DataStore, pack_rows, row_bytes, unpack_rows
from realloc.runtime.wire.protocol import TensorMeta


def rows(lo, hi):
    ids = torch.arange(lo, hi)
    return {"tokens": ids.view(-1, 1).repeat(1, 3), "mask": (ids % 2 == 0).view(-1, 1).repeat(1, 2),
            "logp": ids.float().view(-1, 1) / 10}


def test_ranges_assemble_from_pieces_and_gaps_are_errors():
    s = DataStore()
    s.put("seq", 0, 0, 4, rows(0, 4))
    s.put("seq", 0, 4, 8, rows(4, 8))
    s.put("seq", 0, 2, 6, rows(2, 6))  # overlapping copy from another transfer
    got = s.get("seq", 0, 1, 7)
    want = rows(1, 7)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert s.has("seq", 0, 0, 8) and not s.has("seq", 0, 0, 9) and not s.has("seq", 1, 0, 1)
    with pytest.raises(KeyError, match=r"\[8, 9\)"):
        s.get("seq", 0, 0, 9)
    s.put("seq", 1, 0, 2, rows(0, 2))
    s.release(1)
    assert s.keys() == [("seq", 1)]


def test_pack_unpack_round_trip_mixed_dtypes():
    s = DataStore()
    s.put("seq", 0, 0, 5, rows(0, 5))
    metas = s.meta("seq", 0)
    assert [(m.name, m.dtype, m.shape) for m in metas] == [("logp", "float32", [1]), ("mask", "bool", [2]),
                                                          ("tokens", "int64", [3])]
    assert row_bytes(metas) == 4 + 2 + 24
    buf = pack_rows(s.get("seq", 0, 1, 4), metas)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * 30
    back = unpack_rows(buf, metas, 3)
    want = rows(1, 4)
    assert all(torch.equal(back[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="expected float64"):
        pack_rows(rows(0, 1), [TensorMeta(name="logp", dtype="float64", shape=[1])])
