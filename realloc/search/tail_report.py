"""What ``realloc search`` prints about long-tail migration (issue 31 item 3; docs/long-tail.md): the chosen R_t
and m of each migrating generation call, which consumers run in two parts, and the best plan without migration
beside the winner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from realloc.estimator.chunk_cost import chunked_generation_cost
from realloc.estimator.tail_cost import tail_generation_cost
from realloc.estimator.turn_stream_cost import turn_stream_cost
from realloc.search.mb_stream_space import mb_stream_lines
from realloc.search.tail_reference import TailView

if TYPE_CHECKING:
    from realloc.search.build import PlanSpace
    from realloc.search.planner import SearchReport


def tail_summary(report: "SearchReport") -> list[str]:
    """Lines under the searched plan; none when the search had no migration to choose."""
    if report.no_tail is None:
        return []
    space, plan = report.space, report.plan
    view = TailView(space.problem, report.indices)
    names = space.problem.call_names
    lines = []
    for call, t in plan.tail.items():
        c = names.index(call)
        o = space.options[c][int(report.indices[c])]
        n = space.cost.workload(call).n_seqs
        if t.micro_batches:  # micro-batch streaming across pools (search/mb_stream_space.py)
            lines += mb_stream_lines(space, call, o, t, n, view)
            continue
        if space.cost.rollout_shape(call) is not None:  # a multi-turn stream, priced by turns
            cost = turn_stream_cost(space.cost, call, o.mesh, o.strategy, o.n_mbs, t.rows, t.chunks)[0]
        else:
            cost = (tail_generation_cost(space.cost, call, o.mesh, o.strategy, o.n_mbs, t.rows, t.instances,
                                         "move" if t.moves_kv else "prefill")  # as the runtime does ("auto": moves)
                    if t.chunks == 1 else chunked_generation_cost(space.cost, call, o.mesh, o.strategy, o.n_mbs,
                                                                  t.rows, t.chunks)[0])
        split = [names[v] for v in view.split_of if view.split(v) is not None and names[view.split(v)[1]] == call]
        if t.streams_only:  # no migration: the finished rows stream off the mesh (estimator/stream_cost.py)
            rows = "rollouts" if space.cost.rollout_shape(call) is not None else "rows"
            chunks = f" in {t.chunks} chunks, the last" if t.chunks > 1 else ""
            lines.append(f"streaming: {call} hands its finished {rows} on{chunks} once at most {t.rows} of {n} "
                         f"{rows} ({t.rows / n:.0%}) are running, no migration; before that {cost.phase1:.3f} s, after "
                         f"{cost.phase2:.3f} s")
            parts = f"{t.chunks + 1} parts" if t.chunks > 1 else "two parts"
            lines.append(f"  in {parts} off the generation's devices: {', '.join(split) if split else 'no consumer'}")
            continue
        lines.append(f"long-tail migration: {call} moves its last {t.rows} of {n} rows ({t.rows / n:.0%}) to "
                     f"{t.instances} of {o.strategy.dp} dp replicas; phase 1 {cost.phase1:.3f} s, migration "
                     f"{cost.migration:.3f} s ({'KV caches moved' if cost.kv_moved else 'prefill re-run'}), "
                     f"phase 2 {cost.phase2:.3f} s")
        lines.append(f"  in two parts on the freed devices: {', '.join(split) if split else 'no consumer'}")
    if not plan.tail:
        lines.append("long-tail migration: none (no migration beats running every generation to its end)")
    base, won = report.no_tail.estimated_time, plan.estimated_time
    lines.append(f"best plan without migration: {base:.3f} s per iteration; the searched plan {won:.3f} s "
                 f"({base / won:.2f}x)")
    lines.append(report.no_tail.table(report.graph.topo_order))
    return lines


def gen_inf_span(space: "PlanSpace", indices: np.ndarray, generation: str = "actor_gen",
                 inference: Sequence[str] = ("rew_inf", "ref_inf", "critic_inf")) -> float:
    """Estimated seconds from ``generation``'s start to the end of the last of the ``inference`` calls in a middle
    iteration of the simulator's schedule (RLHFuse's "Gen.+Inf.", rlhfuse.txt §7.2)."""
    names = space.problem.call_names
    want = {names.index(c) for c in (generation, *inference) if c in names}
    t = space.problem.n_iterations // 2
    recs = [r for r in space.cpp.schedule(np.asarray(indices, np.int32)) if r[3] == t and r[1] in want and r[0] != 1]
    start = min(r[4] for r in recs if r[1] == names.index(generation) and r[0] == 0)
    return max(r[5] for r in recs) - start
