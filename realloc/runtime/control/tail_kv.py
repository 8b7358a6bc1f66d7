"""The KV caches of a long-tail migration that moves them (``TailMigration.kv``; models/kv_move.py; docs/streaming.md,
"Moving the KV caches").

After the rows' all-gather (``worker_tail``) every replica knows each tail row's source replica (``src``), whether
phase 1 finished it while running ahead of the counts (``fin``: its results travel whole in the row table, no cache
moves), its prompt length and its source micro-batch's width (``wid``), and the tail replica it is dealt to. So
both ends of every transfer know its rows and sizes: each replica sends, per tail replica, one flat tensor of its
rows' written slots at the migration point (per layer, in the cache dtype; at tp > 1 each tp rank its own heads over
its dp group), point to point; a tail replica keeps the rows it holds itself (cut out of its own caches, no copy
over the wire).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from realloc.models.generation import GenerationOutput, _concat
from realloc.models.kv_move import RowKV, cache_shape, cut_row, decode_moved, pack, packed_size, unpack
from realloc.models.sampling import GenerationConfig
from realloc.models.tail_decode import PhaseOne, select_rows


def _plan(everyone: dict[str, torch.Tensor], tails: list[list[int]]) -> dict[tuple[int, int], list[int]]:
    """(source replica, tail replica) -> the rows (seq ids, in all-gather order) whose caches go from one to the
    other (including a replica's to itself)."""
    dealt = {i: j for j, ids in enumerate(tails) for i in ids}
    out: dict[tuple[int, int], list[int]] = {}
    for i, src, tail, fin in zip(everyone["id"].tolist(), everyone["src"].tolist(), everyone["tail"].tolist(),
                                 everyone["fin"].tolist()):
        if tail and not fin:
            out.setdefault((int(src), dealt[int(i)]), []).append(int(i))
    return out


def exchange(model: Any, one: PhaseOne, seq_ids: list[int], everyone: dict[str, torch.Tensor],
             tails: list[list[int]]) -> dict[int, RowKV]:
    """Send this replica's tail rows' caches to the tail replicas they are dealt to; return the caches of the rows
    dealt to this replica (by seq id; empty on a freed replica)."""
    g = model.groups
    k, step = g.dp_rank, one.step
    plen = dict(zip(everyone["id"].tolist(), everyone["plen"].tolist()))
    local = {int(seq_ids[i]): i for i in one.held}
    dtype = cache_shape(model)[3]
    got: dict[int, RowKV] = {}
    sends, recvs = [], []
    for (src, dst), ids in sorted(_plan(everyone, tails).items()):
        if src == k:
            rows = [cut_row(*one.held[local[i]], int(plen[i]), step) for i in ids]
            if dst == k:
                got.update(zip(ids, rows))
            else:
                buf = pack(rows, dtype).contiguous()
                sends.append((dist.isend(buf, dist.get_global_rank(g.dp_group, dst), group=g.dp_group), buf))
        elif dst == k:
            buf = torch.empty(packed_size(model, [plen[i] for i in ids], step), dtype=dtype, device=model.device)
            recvs.append((dist.irecv(buf, dist.get_global_rank(g.dp_group, src), group=g.dp_group), buf, ids))
    for work, _ in sends:
        work.wait()
    for work, buf, ids in recvs:
        work.wait()
        got.update(zip(ids, unpack(buf, model, [plen[i] for i in ids], step)))
    return got


def moved_phase_two(model: Any, one: PhaseOne, mine: dict[str, torch.Tensor], caches: dict[int, RowKV],
                    finished: GenerationOutput | None, gconfig: GenerationConfig, n_mbs: int) -> GenerationOutput:
    """This tail replica's rows ``mine`` to their end, in their order: those phase 1 finished ahead as they came
    (``finished``: their results, in ``mine``'s order of them), the others decoded on from their caches."""
    ids = [int(i) for i in mine["id"].tolist()]
    fin = mine["fin"].tolist()
    go = [r for r, f in enumerate(fin) if not f]
    outs, order = [], []
    if finished is not None:
        outs.append(finished)
        order += [i for i, f in zip(ids, fin) if f]
    if go:
        steps = one.step + 1
        idx = torch.tensor(go, dtype=torch.long)
        prompts = [mine["prompt"][r, :int(mine["plen"][r])] for r in go]
        width = int(mine["wid"].index_select(0, idx).max())
        outs.append(decode_moved(model, prompts, [ids[r] for r in go], mine["tok"].index_select(0, idx)[:, :steps],
                                 mine["lp"].index_select(0, idx)[:, :steps], [caches[ids[r]] for r in go], width,
                                 gconfig, n_mbs))
        order += [ids[r] for r in go]
    both = outs[0] if len(outs) == 1 else _concat(outs, gconfig.pad_token_id)
    where = {i: r for r, i in enumerate(order)}
    return select_rows(both, [where[i] for i in ids])
