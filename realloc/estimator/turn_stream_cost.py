"""Pricing a multi-turn GENERATE call that streams its finished rollouts (issue 34 item 3; a stream-only ``tail``
entry on a call with a stepwise form, runtime/control/worker_stream.py; docs/multi-turn.md).

The call runs turn by turn (``multiturn_cost.turn_costs``), and a rollout finishes only at a turn's end (the
environment said done, or the turn limit or the budget was hit), so the replicas count the call's running
rollouts after every turn, not every decode step. From the turn profile (``envs/turn_profile.py``), after k turns
``reach[k] x n`` of the call's n rollouts are still running (none after the last turn the estimate prices). Split
point j (threshold ``split_thresholds(n, R, k)[j]``) is the first turn k_j after which at most the threshold run:

- the generation's time to split point j: its dispatch, turns 1..k_j (generation and environment steps), one
  count per turn (an all-reduce over dp) and one request per earlier split point (``chunk_cost._request``); after
  the last split point, the rest of the plain call and one more request (``stream_cost.stream_phase2``);
- chunk j of a split consumer: the rollouts that finished between split points j - 1 and j, as many as the counts
  say (a chunk may be empty when one turn passes two thresholds), priced on the shortest expected lengths as any
  part (``chunk_cost.chunk_work`` with these cuts); the last part is the rollouts still running at the last split
  point (none when the call ended first: then there is no last part);
- the credit a chunk's consumer gets before the last split point (``chunk_cost.lead_shares``) counts turns
  instead of decode steps.

Both simulators read these numbers from the same arrays as any streamed generation (``search/tail_space.py``), so
they agree on a multi-turn stream as on any other.
"""

from __future__ import annotations

from realloc.cluster import DeviceMesh
from realloc.estimator.chunk_cost import _request
from realloc.estimator.cost import CostModel
from realloc.estimator.stream_cost import stream_phase2
from realloc.estimator.tail_cost import COUNT_BYTES, TailCost, _local
from realloc.graph.tail import split_thresholds
from realloc.strategy import ParallelStrategy


def running_after(cost: CostModel, call: str) -> tuple[int, ...]:
    """Rollouts of the whole call still running after turn 1, 2, ..., up to the last turn (0 there): the profile's
    reach, until the mean conversation has used the budget (``gen_len``), as ``multiturn_cost.turn_costs`` walks it."""
    shape = cost.rollout_shape(call)
    assert shape is not None, call
    work = cost.workload(call)
    prof, n = shape.profile, work.n_seqs
    cap = max(1, shape.turn_tokens)
    mean_ctx, out = prof.first_observation, []
    for k in range(prof.turns):
        if work.gen_len - mean_ctx < 1:
            break
        mean_ctx += prof.policy[k].mean(max(1, min(cap, int(work.gen_len - mean_ctx)))) + prof.observations[k]
        out.append(round(prof.reach[k + 1] * n) if k + 1 < prof.turns and work.gen_len - mean_ctx >= 1 else 0)
    return tuple(out) or (0,)


def split_turns(running: tuple[int, ...], n: int, rows: int, chunks: int) -> tuple[int, ...]:
    """The turn (from 1) of each split point: the first after which at most its threshold of rollouts run."""
    return tuple(next(k + 1 for k, r in enumerate(running) if r <= th) for th in split_thresholds(n, rows, chunks))


def turn_stream_cost(cost: CostModel, call: str, mesh: DeviceMesh, strategy: ParallelStrategy, n_mbs: int,
                     rows: int, chunks: int) -> tuple[TailCost, float, tuple[int, ...]]:
    """(the generation's phases: phase 1 to the last split point, phase 2 the rest; the lead T_k - T_1; the
    rollouts running at each split point) of a multi-turn call streamed at ``chunks`` split points down to
    ``rows`` running rollouts."""
    if strategy.pp != 1:
        raise ValueError(f"call {call!r}: a generation streams at its split points at pp 1 only (pp={strategy.pp})")
    model, local = _local(cost, mesh)
    turns = cost.turns(call, mesh, strategy, n_mbs)
    running = running_after(cost, call)
    n = cost.workload(call).n_seqs
    count = model.comm.time("all_reduce", strategy.dp, COUNT_BYTES, model.links(local, strategy).dp)
    at = split_turns(running, n, rows, chunks)
    times = [model.hw.call_overhead + sum(t.time for t in turns[:k]) + k * count + j * _request(cost, mesh)
             for j, k in enumerate(at)]
    raw = times[-1] - (chunks - 1) * _request(cost, mesh)
    return (TailCost(times[-1], 0.0, stream_phase2(cost, call, mesh, strategy, n_mbs, raw), kv_moved=True),
            times[-1] - times[0], tuple(running[k - 1] for k in at))


def turn_lead_shares(running: tuple[int, ...], n: int, rows: int, chunks: int, sharing: int) -> tuple[float, ...]:
    """Per split point j before the last: (T_k - T_j) / (T_k - T_1) counted in turns, over ``sharing`` consumers."""
    at = split_turns(running, n, rows, chunks)
    span = max(1, at[-1] - at[0])
    return tuple((at[-1] - k) / span / max(1, sharing) for k in at[:-1])
