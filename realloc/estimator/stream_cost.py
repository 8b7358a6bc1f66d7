"""Pricing streaming without migration (issue 31 item 2; a ``tail`` entry with ``instances=0``, graph/tail.py;
docs/tail-semantics.md).

No row moves: every dp replica decodes its own rows from start to end, as without the entry, so the generation's
two parts add up to its plain time. Phase 1 runs to the split point, the step after which at most R_t rows are
running (``tail_cost.phase1_cost``, the same as a migration's phase 1); phase 2 is the rest of the plain
generation, plus one ``call_overhead`` for the second request that continues it (the runtime answers the split
point with a reply of its own, ``runtime/control/worker_stream.py``). So an entry without a consumer to stream to
only costs, and the search takes it only where a consumer off the generation's mesh starts earlier.
"""

from __future__ import annotations

from realloc.cluster import DeviceMesh
from realloc.estimator.cost import CostModel
from realloc.strategy import ParallelStrategy


def stream_phase2(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                  phase1: float) -> float:
    """Seconds of a stream-only generation after its split point, given its phase 1 (``tail_cost.phase1_cost``)."""
    # pp 1 only: at pp > 1 the runtime steps every micro-batch through the stages and waits for the step's tokens
    # before the next (models/stream_pipeline.py), priced by pp_stream_cost.stream_rest.
    model = cost.at(mesh) if cost.pool_models else cost
    plain = cost.call_cost(call, mesh, strategy, n_mbs).time
    return max(0.0, plain - phase1) + model.hw.call_overhead
