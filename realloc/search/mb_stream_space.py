"""Micro-batch streaming across pools as a plan choice of the search (issue 32; FlexRLHF Fig. 4b; pricing in
``estimator/mb_stream_cost.py``).

On a cluster of several pools, every generation candidate with m micro-batches (m in ``MB_GRID``; at pp > 1, m waves
of pp micro-batches, models/stream_decode.py) on a mesh smaller than the cluster also comes with a row that hands
each micro-batch (wave) on as it ends:
``TailMigration(rows=R, instances=0, chunks=m-1, micro_batches=True)``. It works with fixed response lengths too (a
micro-batch's rows end together either way), which row streaming cannot use. Its grid index is
``MB_BASE + MB_GRID.index(m)``, after the grid of row streaming and migration (``search/tail_space.py``); the
simulators read it through the arrays of chunked streaming, so they need nothing new. A cluster of one pool gets
no such row: its plans and estimates stay those of before, bit for bit.
"""

from __future__ import annotations

from realloc.estimator.chunk_cost import CHUNK_GRID
from realloc.estimator.cost import CostModel
from realloc.estimator.mb_stream_cost import (MB_GRID, last_rows, mb_chunk_work, mb_generation_cost, mb_lead_shares,
                                             waves)
from realloc.estimator.tail_cost import TAIL_GRID
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.tail import TailMigration

MB_BASE = len(TAIL_GRID) * (1 + len(CHUNK_GRID))  # the first grid index of micro-batch streaming


def streams_micro_batches(graph: DataflowGraph) -> bool:
    """Whether the search offers micro-batch streaming: on a cluster of several pools."""
    return len(graph.spec.cluster.pools) > 1


def mb_of(g: int) -> int | None:
    """The micro-batch count of grid index ``g``, or None: a row-streaming or migration entry."""
    return MB_GRID[g - MB_BASE] if g >= MB_BASE else None


def mb_rows(cost: CostModel, call: str, i: int, cand, n: int) -> tuple[list[tuple[int, float]], list[tuple]]:
    """Candidate ``i``'s micro-batch streaming row (none unless its micro-batches, or at pp > 1 its waves of pp
    micro-batches, number one of the grid): (candidate, phase 1) and the fields of its ``tail_space.TailChoice``."""
    s = cand.strategy
    m = waves(s, cand.n_mbs)  # pp > 1: waves of pp micro-batches (estimator/mb_stream_cost.py)
    if m not in MB_GRID or m > n:
        return [], []
    tc, lead = mb_generation_cost(cost, call, cand.mesh, s, cand.n_mbs)
    entry = TailMigration(rows=last_rows(n, m), instances=0, chunks=m - 1, micro_batches=True)
    return [(i, tc.phase1)], [(entry, MB_BASE + MB_GRID.index(m), s.dp * s.tp * s.pp, tc.phase2, lead)]


def mb_split_columns(cost: CostModel, consumer: str, producer: str, cand, g: int, sharing: int
                     ) -> tuple[float, float, list[float], list[float]]:
    """A split consumer's arrays at micro-batch grid index ``g`` for its candidate ``cand``: (part 1: the chunk
    before the last split point, part 2: the last micro-batch, the work of chunks j.. for each earlier split
    point j, the shares of the producer's lead)."""
    m = mb_of(g)
    assert m is not None, g
    chunks, last = mb_chunk_work(cost, consumer, producer, cand.mesh, cand.strategy, cand.n_mbs, m)
    work = [sum(chunks[j:]) for j in range(m - 2)]
    return chunks[-1], last, work, list(mb_lead_shares(m, sharing))


def mb_stream_lines(space, call: str, o, t: TailMigration, n: int, view) -> list[str]:
    """``realloc search``'s lines for a generation that hands its micro-batches on (``search/tail_report.py``): the
    pool of the generation and of each consumer it streams to."""
    names = space.problem.call_names
    tc, _ = mb_generation_cost(space.cost, call, o.mesh, o.strategy, o.n_mbs)
    pools = space.graph.spec.cluster.pools

    def where(c: int) -> str:
        mesh = space.options[c][int(view.plan[c])].mesh
        return f"{mesh.name} (pool {mesh.pool}: {pools[mesh.pool].device})"

    split = [f"{names[v]} on {where(v)}" for v in view.split_of
             if view.split(v) is not None and names[view.split(v)[1]] == call]
    unit = "micro-batches" if o.strategy.pp == 1 else f"waves of {o.strategy.pp} micro-batches"
    return [f"streaming: {call} on {where(names.index(call))} hands each of its {t.chunks + 1} {unit} "
            f"({n - t.rows} rows before the last) on as it ends, one after another, no migration; before the last "
            f"{tc.phase1:.3f} s, the last {tc.phase2:.3f} s",
            f"  in {t.chunks + 1} parts off the generation's devices: {', '.join(split) if split else 'no consumer'}"]
