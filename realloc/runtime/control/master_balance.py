"""Token-balanced dp ranks by row lists, the master's side (``RunConfig.balance_tokens``; graph/row_deal.py).

Once the generation reported each sequence's tokens, every later call's dp ranks get row lists with near-equal
tokens (per mini-batch for a train step). Calls with the same dealing (dp, group, mini-batches, micro-batches) in
one iteration share it, so it is computed once. The lists go into the master's ``row_lists`` (its transfers
then move lists of rows, as a streamed call's do) and into the call's request (``RunCall.rows``).
"""

from __future__ import annotations

from typing import Any, Sequence

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
