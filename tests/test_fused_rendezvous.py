"""The fused train step under NCCL's point-to-point semantics, on CPU (issue 33; docs/fused-training.md).

``tests/rendezvous_p2p.py`` gives gloo's ``isend``/``irecv`` what NCCL has and gloo lacks: a send completes only
together with its receive, one pair of ranks' operations complete one after the other in the order posted, and
messages pair by that order, not by tag. First, small programs show it can fail: a send posted before a receive
on both sides (which gloo completes) deadlocks, receives posted in another order than the sends raise, and the
fused step with each receive posted only just before its pass (which gloo runs exactly) deadlocks. Then the real fused train step (``models/fused_train.fused_train_step``, its programs from
``models/fused_protocol.py``) runs through it at pp 2, tp 1 and 2, 2 to 8 micro-batches, both models, and leaves
both models' parameters and optimizer states equal to each model's own ``train_step`` (gloo's, unchanged).
"""

from __future__ import annotations

import pytest
import torch

from mp_pool import GlooPool
from rendezvous_p2p import RendezvousP2P
from test_fused_train import _both, _order


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(4, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _exchange(ctx, program: str, wrapped: bool):
    """Ranks 0 and 1 exchange two tensors; ``program`` says in which order they post. Returns what arrived."""
    import torch.distributed as dist

    p2p = RendezvousP2P(timeout=3.0) if wrapped else dist
    if ctx.rank > 1:
        return None
    peer = 1 - ctx.rank
    mine = [torch.full((4,), 10.0 * ctx.rank + k + 1) for k in range(2)]
    got = [torch.zeros(4) for _ in range(2)]
    if program == "send first on both sides":  # each rank's send waits for a receive queued behind the peer's send
        works = [p2p.isend(mine[0], peer, tag=1), p2p.irecv(got[0], peer, tag=1)]
    elif program == "one way, then back":
        first = ctx.rank == 0
        works = ([p2p.isend(mine[0], peer, tag=1), p2p.irecv(got[0], peer, tag=1)] if first
                 else [p2p.irecv(got[0], peer, tag=1), p2p.isend(mine[0], peer, tag=1)])
    else:  # "receives in another order": rank 1 posts its receives in the reverse order of rank 0's sends
        if ctx.rank == 0:
            works = [p2p.isend(mine[0], peer, tag=1), p2p.isend(mine[1], peer, tag=2)]
        else:
            works = [p2p.irecv(got[1], peer, tag=2), p2p.irecv(got[0], peer, tag=1)]
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:  # every rank's own outcome, not only the first failing rank's
        return f"{type(e).__name__}: {e}"
    return [g.tolist() for g in got]


def test_the_wrapper_has_nccls_semantics(tmp_path):
    with GlooPool(2, tmp_path / "a") as pool:
        # gloo completes all three programs
        for program in ("send first on both sides", "one way, then back", "receives in another order"):
            assert pool.run(_exchange, program, False, timeout=60)[1][0] == [1.0] * 4
        assert pool.run(_exchange, "one way, then back", True, timeout=60) == [[[11.0] * 4, [0.0] * 4],
                                                                               [[1.0] * 4, [0.0] * 4]]
        # a deadlock leaves threads blocked in gloo, whose messages the next program would get: a pool each
        sends_first = pool.run(_exchange, "send first on both sides", True, timeout=60)
    assert all(r.startswith("RendezvousDeadlock") for r in sends_first), sends_first
    with GlooPool(2, tmp_path / "b") as pool:
        reordered = pool.run(_exchange, "receives in another order", True, timeout=60)
    assert reordered[0].startswith("RendezvousDeadlock") and "different orders" in reordered[1], reordered


def _both_rendezvous(ctx, layouts, n_mbs, recompute, order, timeout=120.0):
    from realloc.models import fused_pipeline

    p2p = RendezvousP2P(timeout=timeout)
    with p2p.installed(fused_pipeline):
        worst = _both(ctx, layouts, n_mbs, recompute, order)
    return worst, p2p.ops


# (actor dp, tp, pp), (critic dp, tp, pp), micro-batches, recompute, order
CASES = [
    (((2, 1, 2), (2, 1, 2)), (8, 2), (False, True), "search"),
    (((1, 2, 2), (1, 2, 2)), (4, 3), (True, False), "search"),
    (((2, 1, 2), (1, 2, 2)), (2, 8), (False, False), "greedy"),
]


@pytest.mark.parametrize("layouts,n_mbs,recompute,which", CASES, ids=["tp1", "tp2", "tp1+tp2-greedy"])
def test_the_fused_step_completes_under_rendezvous_semantics_and_equals_serial(pool, layouts, n_mbs, recompute,
                                                                              which):
    order = _order(n_mbs, which)
    for worst, ops in pool.run(_both_rendezvous, layouts, n_mbs, recompute, order, timeout=300):
        assert ops > 0  # the fused step's messages went through the wrapper
        assert worst <= 1e-6



def _lazy_receives(programs):
    """Each group's program with every receive posted only just before the pass that needs it (a protocol that
    waits for its inputs the way one model's 1F1B does, and deadlocks under rendezvous semantics)."""
    out = []
    for prog in programs:
        lazy = []
        for op in prog:
            if op[0] == "pass" and ("recv", *op[1:]) in prog:
                lazy.append(("recv", *op[1:]))
            if op[0] != "recv":
                lazy.append(op)
        out.append(lazy)
    return out


def _lazy(ctx, layouts, n_mbs, recompute, order, wrapped: bool):
    from realloc.models import fused_pipeline

    real = fused_pipeline.build_programs
    fused_pipeline.build_programs = lambda orders: _lazy_receives(real(orders))
    try:
        return _both_rendezvous(ctx, layouts, n_mbs, recompute, order, timeout=10.0)[0] if wrapped else \
            _both(ctx, layouts, n_mbs, recompute, order)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        fused_pipeline.build_programs = real


def test_a_protocol_that_posts_receives_late_deadlocks_here(tmp_path):
    """The same step with each receive posted just before its pass: gloo runs it, the wrapper finds it stuck."""
    layouts, n_mbs, order = ((2, 1, 2), (2, 1, 2)), (4, 4), _order((4, 4), "search")
    with GlooPool(4, tmp_path) as pool:
        assert all(worst <= 1e-6 for worst in pool.run(_lazy, layouts, n_mbs, (False, False), order, False))
        got = pool.run(_lazy, layouts, n_mbs, (False, False), order, True, timeout=120)
    assert all(isinstance(r, str) and r.startswith("RendezvousDeadlock") for r in got), got
