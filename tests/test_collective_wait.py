"""The bounded busy-wait for CPU collectives (``realloc/models/collective_wait.py``): it falls back to
``work.wait()`` after its bound, leaves CUDA tensors' calls blocking as they were, and changes no result: a
collective's, and the whole state of dp-2 train steps (parameters, AdamW moments, returned stats) equal the
blocking version's bit for bit."""

from __future__ import annotations

import pytest
import torch

from realloc.models import collective_wait
from realloc.models.collective_wait import SPIN_ENV, blocking, finish, spin_seconds
from mp_pool import GlooPool


class _Work:
    """A stand-in for an async collective's work that completes after ``polls`` calls of is_completed (never
    when None), or when waited for."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.checked, self.waited = polls, 0, 0

    def is_completed(self) -> bool:
        self.checked += 1
        return self.waited > 0 or (self.polls is not None and self.checked > self.polls)

    def wait(self) -> bool:
        self.waited += 1
        return True


def test_finish_falls_back_to_wait_after_the_bound():
    work = _Work(None)  # never completes by itself
    assert finish(work, 0.002) is False
    assert work.waited == 1 and work.checked > 1  # it polled, then slept in wait() once


def test_finish_returns_when_completed_within_the_bound_and_still_waits_once():
    work = _Work(3)
    assert finish(work, 60.0) is True  # the bound is far away: it stops because the work completed
    assert work.checked == 5 and work.waited == 1  # 4 polls in the loop, 1 after it; wait() raises errors


def test_finish_without_spin_waits_at_once():
    work = _Work(None)
    assert finish(work, 0.0) is False
    assert work.checked == 1 and work.waited == 1


def test_spin_setting(monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert spin_seconds() == collective_wait.DEFAULT_SPIN_MS / 1e3
    monkeypatch.setenv(SPIN_ENV, "2.5")
    assert spin_seconds() == 0.0025
    for bad in ("fast", "-1", "nan", "inf"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(ValueError, match=SPIN_ENV):
            spin_seconds()


def test_non_cpu_tensors_take_the_blocking_call(monkeypatch):
    monkeypatch.setenv(SPIN_ENV, "5")
    calls = []

    def fake(t, *a, **k):
        calls.append(k)
        return _Work(0) if k.get("async_op") else None

    blocking(fake, torch.empty(2, device="meta"), group="g")
    blocking(fake, torch.empty(2), group="g")
    assert calls == [{"group": "g"}, {"group": "g", "async_op": True}]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _collectives(ctx, spin: str):
    """An all-reduce, a reduce-scatter and an all-gather, rank 1 entering 30 ms late, under ``spin``."""
    import os
    import time

    import torch.distributed as dist

    os.environ[SPIN_ENV] = spin
    try:
        g = torch.Generator().manual_seed(10 + ctx.rank)
        x = torch.randn(1000, generator=g, dtype=torch.float64)
        if ctx.rank == 1:
            time.sleep(0.03)
        blocking(dist.all_reduce, x)
        flat = torch.randn(64, generator=g)
        mine = torch.empty(32)
        blocking(dist.reduce_scatter_single, mine, flat)
        whole = torch.empty(64)
        blocking(dist.all_gather_single, whole, mine)
        return x, mine, whole
    finally:
        os.environ.pop(SPIN_ENV)


def test_collective_results_equal_the_blocking_ones(pool):
    plain = pool.run(_collectives, "0")
    for spin in ("1", "200"):  # falls back to wait(), and completes within the spin
        got = pool.run(_collectives, spin)
        for a, b in zip(plain, got):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def _train_state(ctx, spin: str):
    """Three dp-2 train steps of the tiny model (distributed optimizer, gradient clipping, loss stats), unequal
    rows per replica; the whole state after them."""
    import os

    from model_helpers import build_model, local_shards
    from realloc.models.config import get_model_config
    from test_model_train import _micro_batches, nll_loss

    os.environ[SPIN_ENV] = spin
    try:
        model = build_model(ctx, get_model_config("tiny"), 2, 1, 1, seed=3)
        opt = model.make_optimizer(lr=1e-3)
        stats = [model.train_step(_micro_batches(7 * step + ctx.rank, rows=2 + ctx.rank, vocab=64), nll_loss, opt,
                                  max_grad_norm=0.5) for step in range(3)]
        moments = [{k: v.clone() for k, v in opt.inner.state[c].items()} for c in opt.chunks.values()]
        return local_shards(model), moments, stats
    finally:
        os.environ.pop(SPIN_ENV)


def test_dp2_train_steps_equal_the_blocking_ones(pool):
    plain = pool.run(_train_state, "0")
    spun = pool.run(_train_state, "50")
    for (shards_a, mom_a, stats_a), (shards_b, mom_b, stats_b) in zip(plain, spun):
        assert stats_a == stats_b and stats_a[0]["grad_norm"] > 0
        assert shards_a["shards"].keys() == shards_b["shards"].keys()
        for n, t in shards_a["shards"].items():
            assert torch.equal(t, shards_b["shards"][n]), n
        assert len(mom_a) == len(mom_b) > 0
        for a, b in zip(mom_a, mom_b):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the replicas trained on different rows, yet hold the same parameters: the dp collectives ran
    assert all(torch.equal(t, plain[1][0]["shards"][n]) for n, t in plain[0][0]["shards"].items())
