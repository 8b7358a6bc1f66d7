"""Seconds to execute a parameter-reallocation or data-transfer plan (realhf.txt section 6).

The bytes come from the ONE planner the runtime executes,
``realloc.graph.transfer_plan`` (who sends which slice to whom); this module
only prices that plan, following how ``realloc.runtime.transfer.param_realloc`` runs it:

- pieces one source sends to the same destinations travel together as one
  message, in buckets of at most ``BUCKET_BYTES``; a piece of ``DIRECT_BYTES`` or
  more goes alone (zero copy);
- a message with one destination is a p2p send, with several a broadcast over
  the group (source + destinations);
- all messages are started at once and then awaited, so messages that share no
  device overlap, and messages that share a device serialize on its link.

So the plan takes max over devices of the sum, over the messages the device is
part of, of alpha + beta * bytes of that message (``CommModel``), with the
inter-node link whenever a destination sits on another node than the source.
Local copies (a device keeping a piece it already holds) overlap the messages and
are not counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

from realloc.estimator.comm import CommModel, Link
from realloc.graph.transfer_plan import TransferPlan

# The message sizes of realloc.runtime.transfer.param_realloc (DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_BYTES);
# tests/test_estimator_transfer.py checks they agree. Not imported: that module needs torch.
BUCKET_BYTES = 64 * 2**20
DIRECT_BYTES = 256 * 2**10


def plan_seconds(plan: TransferPlan, comm: CommModel, devices_per_node: int,
                 message_time: Callable[[str, int, tuple[int, ...], float], float] | None = None) -> float:
    """Wall time of ``plan``: the busiest device's serialized messages. ``message_time(op, src, dsts, nbytes)``,
    if given, prices one message instead of ``comm`` (a cluster of pools: ``pool_link.py``)."""
    if plan.empty:
        return 0.0
    # (src, dsts) -> bucketed bytes, and the number of direct messages with their bytes
    bucketed: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
    direct: list[tuple[int, tuple[int, ...], int, int]] = []  # (src, dsts, nbytes, count)
    for cls in plan.classes:
        mult = len(cls.members)
        for _item, src, dsts, _lo, _hi, nbytes in cls.transfers:
            if nbytes >= DIRECT_BYTES:
                direct.append((src, dsts, nbytes, mult))
            else:
                bucketed[src, dsts] += nbytes * mult
    busy: dict[int, float] = defaultdict(float)

    def add(src: int, dsts: tuple[int, ...], nbytes: float, count: int) -> None:
        op = "p2p" if len(dsts) == 1 else "broadcast"
        if message_time is not None:
            t = count * message_time(op, src, dsts, nbytes)
        else:
            link = Link.INTER if any(d // devices_per_node != src // devices_per_node for d in dsts) else Link.INTRA
            t = count * comm.time(op, len(dsts) + 1, nbytes, link)
        busy[src] += t
        for d in dsts:
            busy[d] += t

    for (src, dsts), total in bucketed.items():
        n_msgs = max(1, math.ceil(total / BUCKET_BYTES))
        add(src, dsts, total / n_msgs, n_msgs)
    for src, dsts, nbytes, count in direct:
        add(src, dsts, nbytes, count)
    return max(busy.values())
