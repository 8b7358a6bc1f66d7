"""The worker's side of a fused pair (runtime/control/worker_fused.py) without processes: two calls' interface
functions, each taking optimizer steps through its model's ``train_step``, have each step of one fused with the
same step of the other, in a fixed order; a step the other call does not take runs alone; a failure in either
call, or in the fused step, ends the request with that error and leaves no thread behind."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from realloc.runtime.control import worker_fused
from realloc.runtime.wire import protocol


class FakeModel:
    def __init__(self, name: str, events: list) -> None:
        self.name, self.events = name, events
        self.groups = SimpleNamespace(pp_rank=0)

    def train_step(self, micro_batches, loss_fn, optimizer, **kw):
        self.events.append(("alone", self.name, micro_batches))
        return {"grad_norm": -1.0}


def _worker(tmp_path, steps: dict[str, int], events: list, fail: tuple[str, int] | None = None):
    models = {c: FakeModel(c, events) for c in steps}

    def run_call(call, iteration, ranges=None, rows=None):
        events.append(("start", call))
        norms = []
        for k in range(steps[call]):
            if fail == (call, k):
                raise ValueError(f"{call} failed at step {k}")
            norms.append(models[call].train_step(k, None, None, max_grad_norm=1.0)["grad_norm"])
            events.append(("after", call, k))
        return {f"{call}_norms": sum(norms)}, []

    return SimpleNamespace(program=SimpleNamespace(calls={c: SimpleNamespace(key=c) for c in steps}),
                           handles={c: SimpleNamespace(model=m) for c, m in models.items()}, device=SimpleNamespace(
                               type="cpu"), run_call=run_call, run_dir=tmp_path, rank=0)


@pytest.fixture
def fused_steps(monkeypatch):
    calls = []

    def fake(models, args, order, record=None):
        calls.append([(m.name, a.micro_batches, a.max_grad_norm) for m, a in zip(models, args)])
        if len(calls) == fake.fail_at:
            raise RuntimeError("fused step failed")
        return {"grad_norm": 1.0}, {"grad_norm": 2.0}

    fake.fail_at = 0
    monkeypatch.setattr(worker_fused, "fused_train_step", fake)
    return fake, calls


def _request() -> protocol.RunCall:
    return protocol.RunCall(req=7, call="a", iteration=0, fused_with="b", fused_order=[[[0, 0, 0]]])


def test_each_step_of_one_call_is_fused_with_the_same_step_of_the_other(tmp_path, fused_steps):
    _, calls = fused_steps
    events: list = []
    before = set(threading.enumerate())
    stats, metas = worker_fused.run_fused_pair(_worker(tmp_path, {"a": 2, "b": 3}, events), _request())
    assert calls == [[("a", 0, 1.0), ("b", 0, 1.0)], [("a", 1, 1.0), ("b", 1, 1.0)]]
    # a runs to its first step, then b; after each fused step a goes on to its next step, then b; b's third step
    # has no partner and runs alone (the model's own train_step)
    assert events == [("start", "a"), ("start", "b"), ("after", "a", 0), ("after", "b", 0), ("after", "a", 1),
                      ("after", "b", 1), ("alone", "b", 2), ("after", "b", 2)]
    assert stats == {"a_norms": 2.0, protocol.FUSED_SECOND_STATS + "b_norms": 2.0 + 2.0 - 1.0} and metas == []
    assert set(threading.enumerate()) <= before  # no thread of its own left


@pytest.mark.parametrize("fail", [("a", 1), ("b", 0), "fused"])
def test_a_failure_ends_the_request_with_its_error_and_no_thread_left(tmp_path, fused_steps, fail):
    fake, _ = fused_steps
    before = set(threading.enumerate())
    if fail == "fused":
        fake.fail_at = 2
    expected = "fused step failed" if fail == "fused" else f"{fail[0]} failed at step {fail[1]}"
    with pytest.raises((ValueError, RuntimeError), match=expected):
        worker_fused.run_fused_pair(_worker(tmp_path, {"a": 2, "b": 2}, [], None if fail == "fused" else fail),
                                    _request())
    assert set(threading.enumerate()) <= before  # no thread of its own left
