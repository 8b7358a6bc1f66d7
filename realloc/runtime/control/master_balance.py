"""Token-balanced dp ranks by row lists, the master's side (``RunConfig.balance_tokens``; graph/row_deal.py).

Once the generation reported each sequence's tokens, every later call's dp ranks get row lists with near-equal
tokens (per mini-batch for a train step). Calls with the same dealing (dp, group, mini-batches, micro-batches) in
one iteration share it, so it is computed once. The lists go into the master's ``row_lists`` (its transfers
then move lists of rows, as a streamed call's do) and into the call's request (``RunCall.rows``).

Dealing a train call's lists (per mini-batch) takes the master 5-6 ms of CPU for 128 rows. Its inputs' transfers,
which need them, used to be planned when the generation finished, between its end and the first inference call's
dispatch; they now wait (``defer_push``) until a call of the iteration was dispatched, and the calls ready with it
too (the next turn of the event loop), or the train call itself starts (``flush_deferred``). The same lists, transfers and results: only when the master computes them moves.
"""

from __future__ import annotations

from typing import Any, Sequence

from realloc.calls import InterfaceType
from realloc.graph.row_deal import Shares, deal_rows


def deal_rows_cached(master: Any, tokens: Sequence[int], t: int, dp: int, unit: int, n_minibatches: int,
                     n_mbs: int) -> Shares:
    """``deal_rows`` of iteration t's tokens, computed once per iteration and setting (``master.deal_cache``)."""
    key = (t, dp, unit, n_minibatches, n_mbs)
    got = master.deal_cache.get(key)
    if got is None:
        got = master.deal_cache[key] = deal_rows(tokens, dp, unit=unit, n_minibatches=n_minibatches,
                                                 min_rows=n_mbs)
    return got


def defer_push(master: Any, consumer: str, t: int) -> bool:
    """Whether ``consumer``'s input transfers of iteration t wait (module docstring): a train call whose row lists
    are still to be dealt (balance_tokens, dp > 1, not split around a tail), or one with transfers waiting already
    (its transfers keep their order)."""
    if (consumer, t) in master.deferred:
        return True
    if (consumer, t) in master.row_ranges or consumer in master.splits or not master._balanced_generation():
        return False
    rpc, cl = master.graph.call(consumer), master.program.calls[consumer]
    return rpc.interface_type is InterfaceType.TRAIN_STEP and cl.strategy.dp > 1


def flush_deferred(master: Any, t: int, *consumers: str) -> None:
    """Plan and send the waiting transfers of iteration t (only those of ``consumers`` when given: a call, or a
    fused pair, about to start), in the order their producers finished (``_push_outputs``'s order)."""
    for c, tt in [k for k in master.deferred if k[1] == t and (not consumers or k[0] in consumers)]:
        for key in master.deferred.pop((c, tt)):
            master.pushed.setdefault((c, t), []).extend(master._transfer(key, c, t))
