"""Phase 2 of a long-tail migration from moved KV caches (issue 31 item 3, "move their KV caches or re-run their
prefill"; rlhfuse.txt §4; docs/streaming.md, "Moving the KV caches").

At the migration point every tail row has generated ``g = step + 1`` tokens; its keys and values fill its written
slots: the prompt's ``plen`` and the ``step`` decoded tokens fed back so far, ``plen + step`` slots
(``row_slots``). A replica that holds a tail row in one of phase 1's micro-batches cuts those slots out of its
cache (a row phase 1 decoded past the migration point is cut back to it: its later slots are left behind), and a
tail replica that gets rows from other replicas receives them, per layer, in the cache dtype (``pack`` /
``unpack``: one flat tensor per pair of replicas, sizes known on both ends from the rows' prompt lengths).

``decode_moved`` lays the rows out as phase 1 did -- left-padded to ``width`` slots, the widest prompt of their
source micro-batches, then one slot per step -- and decodes from step ``g`` on, with the same step numbers, so each
row's sampling draws, length schedule and EOS ban are read where an unmigrated run reads them. No prefill runs.

Exactness: a tail replica that decodes only rows of one source micro-batch, in their order (its own tail with one
micro-batch), runs the unmigrated run's very operations: the same batch, the same slots, bit for bit. Rows put
together from several micro-batches decode in a batch of another size, and the CPU's matrix kernels round a row
differently at another batch size (about 5e-7 on the tiny model), so there the log-probs agree within float
tolerance and the tokens agree unless a draw lands within that difference of a boundary -- as with the re-run
prefill, but without the prefill's own rounding and its time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from realloc.models.generation import GenerationOutput, _concat, _MicroBatch
from realloc.models.llama import KVCache, cache_mask
from realloc.models.sampling import GenerationConfig
from realloc.models.static_decode import DecodingModel
from realloc.strategy import even_ranges

RowKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values [local kv heads, slots, head_dim]


def row_slots(plen: int, step: int) -> int:
    """Written cache slots of a row with a ``plen``-token prompt at migration step ``step``: the prompt's, then one
    per token fed back (steps 1..step)."""
    return plen + step


def cut_row(caches: list[KVCache], row: int, width: int, plen: int, step: int) -> RowKV:
    """Row ``row``'s written slots in ``caches`` (a micro-batch left-padded to ``width`` slots), cut at ``step``:
    views, copied when packed or laid out."""
    lo, hi = width - plen, width + step
    return [(c.k[row, :, lo:hi], c.v[row, :, lo:hi]) for c in caches]


def cache_shape(model: DecodingModel) -> tuple[int, int, int, torch.dtype]:
    """(layers, local kv heads, head_dim, dtype) of this rank's caches."""
    one = model.stage.new_kv_caches(1, 1)
    return len(one), int(one[0].k.shape[1]), int(one[0].k.shape[3]), one[0].k.dtype


def pack(rows: Sequence[RowKV], dtype: torch.dtype) -> torch.Tensor:
    """The rows' keys and values in one flat tensor: row by row, layer by layer, keys then values."""
    parts = [t.reshape(-1) for kv in rows for k, v in kv for t in (k, v)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def packed_size(model: DecodingModel, plens: Sequence[int], step: int) -> int:
    layers, heads, dim, _ = cache_shape(model)
    return sum(2 * layers * heads * row_slots(p, step) * dim for p in plens)


def unpack(buf: torch.Tensor, model: DecodingModel, plens: Sequence[int], step: int) -> list[RowKV]:
    """``pack``'s rows back, as views of ``buf``."""
    layers, heads, dim, _ = cache_shape(model)
    out, at = [], 0
    for p in plens:
        n = heads * row_slots(p, step) * dim
        kv = []
        for _ in range(layers):
            k = buf[at:at + n].view(heads, -1, dim)
            v = buf[at + n:at + 2 * n].view(heads, -1, dim)
            kv.append((k, v))
            at += 2 * n
        out.append(kv)
    assert at == buf.numel(), (at, buf.numel())
    return out


@torch.no_grad()
def decode_moved(model: DecodingModel, prompts: list[torch.Tensor], seq_ids: list[int], tokens: torch.Tensor,
                 logprobs: torch.Tensor, caches: list[RowKV], width: int, gconfig: GenerationConfig,
                 n_mbs: int = 1) -> GenerationOutput:
    """Decode tail rows to their end from their moved caches (``caches[r]``: row r's written slots at the
    migration step ``g - 1``, ``tokens`` / ``logprobs`` [rows, g] its first g tokens); the rows are laid out
    ``width`` slots wide (at least their longest prompt). The result covers the whole response, in row order."""
    n, g = len(seq_ids), int(tokens.shape[1])
    assert n and 0 < g < gconfig.max_new_tokens and width >= max(p.numel() for p in prompts), (n, g, width)
    model.stage.eval()
    dev = model.device
    outs = []
    for lo, hi in even_ranges(n, max(1, min(n_mbs, n))):
        mb = _MicroBatch(model, prompts[lo:hi], seq_ids[lo:hi], gconfig)
        _lay_out(model, mb, caches[lo:hi], width, g)
        mb.out_tok[:, :g] = tokens[lo:hi].to(dev)
        mb.out_lp[:, :g] = logprobs[lo:hi].to(dev)
        mb.gen_len[:] = g
        # step g's inputs, as ``_MicroBatch.apply`` leaves them after step g - 1 with every row still running
        slot = width + g - 1
        pos = (mb.plen_d + g - 1).view(-1, 1)
        mb.inputs = (mb.out_tok[:, g - 1:g].clone(), pos, cache_mask(mb.key_valid[:, :slot + 1], slot, 1), slot)
        t = g
        while not mb.done:
            mb.apply(mb.sample(mb.forward(None, t), t), t)
            t += 1
        outs.append(mb.output())
    return outs[0] if len(outs) == 1 else _concat(outs, gconfig.pad_token_id)


def _lay_out(model: DecodingModel, mb: _MicroBatch, rows: list[RowKV], width: int, g: int) -> None:
    """Give ``mb`` (made for a prefill of its prompts) the caches and key mask of phase 1's layout at step g - 1:
    each row's prompt right-aligned at ``width``, slots [width, width + g) its fed-back tokens (the last, step g - 1's
    token, is fed at step g)."""
    n = len(rows)
    mb.P = width
    mb.caches = model.stage.new_kv_caches(n, width + mb.N, zeroed=width)  # left padding: zeros, masked
    mb.kept = []
    valid = torch.zeros((n, width + mb.N), dtype=torch.bool)
    for b, (kv, p) in enumerate(zip(rows, mb.plen.tolist())):
        lo, hi = width - p, width + g - 1
        valid[b, lo:hi + 1] = True
        for c, (k, v) in zip(mb.caches, kv):
            c.k[b, :, lo:hi] = k
            c.v[b, :, lo:hi] = v
        pos = mb.caches[0].pos
        if pos is not None:  # a sliding window's slot positions: the row's token positions (one tensor, all layers)
            pos[b, lo:hi] = torch.arange(hi - lo, device=pos.device)
    mb.key_valid = valid.to(mb.key_valid.device)
