"""A worker runs a fused train pair (plan field 'fused', docs/fused-training.md) as one request.

The two calls' interface functions stay what they are: each runs in ``ModelWorker.run_call`` (inputs,
mini-batches, learning-rate schedule, stats, outputs) on a thread of its own, and the only thing that changes
is its model's ``train_step``: it hands its arguments over and waits. Once both calls wait in a train step
(one optimizer step of each), this thread runs the two as one fused schedule
(``models/fused_train.fused_train_step``), hands each its stats back, and the calls go on to their next
optimizer step. A call that ends, or takes a step the other does not, runs that step alone (unfused).

The threads never run at the same time: one baton passes between this thread and the two calls in a fixed
order (first call, second call, the fused step), so every rank issues its collectives in the same order, as
a worker always does (worker.py), and nothing in the calls needs to be thread-safe.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from realloc.models.fused_train import TrainArgs, fused_train_step
from realloc.runtime.records.fused_passes import write_passes
from realloc.runtime.wire import protocol


_MAIN = -1

log = logging.getLogger("realloc.worker")


class _Baton:
    """Whose turn it is: this thread (_MAIN) or call 0 or 1."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn = _MAIN

    def give(self, to: int) -> None:
        with self._cv:
            self._turn = to
            self._cv.notify_all()

    def wait(self, mine: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == mine)


class _Abort(BaseException):
    """Ends a call's thread waiting in a train step when the other call or the fused step failed (a
    BaseException, so that an interface's ``except Exception`` cannot swallow it and step again)."""


class _Side:
    """One call of the pair on its thread."""

    def __init__(self, index: int, baton: _Baton, model: Any, body: Callable[[], Any],
                 device: torch.device) -> None:
        self.index, self.baton, self.model = index, baton, model
        self.state = "new"  # running | waiting (a train step handed over) | done
        self.args: TrainArgs | None = None
        self.reply: dict[str, float] | None = None
        self.abort = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(body, device), name=f"fused-call-{index}",
                                       daemon=True)

    def _run(self, body: Callable[[], Any], device: torch.device) -> None:
        self.baton.wait(self.index)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            self.model.train_step = self._train_step  # this instance only, for the call's duration
            self.result = body()
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the request's thread, which raises it
            self.error = e
        finally:
            self.model.__dict__.pop("train_step", None)
            self.state = "done"
            self.baton.give(_MAIN)

    def _train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.args, self.reply = TrainArgs.of_call(args, kwargs), None
        self.state = "waiting"
        self.baton.give(_MAIN)
        self.baton.wait(self.index)
        if self.abort:
            raise _Abort()
        assert self.reply is not None
        return self.reply

    def resume(self) -> None:
        """Let the call run until its next train step or its end."""
        if self.state == "new":
            self.state = "running"
            self.thread.start()
        elif self.state == "waiting":
            self.state = "running"
        else:
            return
        self.baton.give(self.index)
        self.baton.wait(_MAIN)


def run_request(worker: Any, req: protocol.RunCall) -> tuple[dict[str, float], list[protocol.OutputMeta]]:
    """A ``RunCall`` on ``worker`` (the ``ModelWorker``, worker.py): a fused pair's two calls as one
    (``run_fused_pair``), or its one call."""
    if req.fused_with:
        return run_fused_pair(worker, req)
    return worker.run_call(req.call, req.iteration, req.eval_batch, req.layout_call, req.ranges, req.rows)


def run_fused_pair(worker: Any, req: protocol.RunCall) -> tuple[dict[str, float], list[protocol.OutputMeta]]:
    """``req.call`` and ``req.fused_with`` as one request: their interfaces with every optimizer step fused.
    ``worker``: the ``ModelWorker`` (worker.py, which imports this module) whose ``run_call`` runs each call."""
    prog = worker.program
    first, second = req.call, req.fused_with
    handles = [worker.handles[prog.calls[c].key] for c in (first, second)]
    orders = [[(int(m), int(b), int(i)) for m, b, i in stage] for stage in req.fused_order]
    baton = _Baton()
    sides = [_Side(0, baton, handles[0].model,
                   lambda: worker.run_call(first, req.iteration, ranges=req.ranges, rows=req.rows), worker.device),
             _Side(1, baton, handles[1].model,
                   lambda: worker.run_call(second, req.iteration, ranges=req.fused_ranges, rows=req.fused_rows),
                   worker.device)]
    fused = alone = 0
    passes: list[list[float]] = []  # (step, model, backward, micro-batch, start, end) for the timeline
    try:
        while True:
            for s in sides:
                s.resume()
            failed = next((s.error for s in sides if s.error is not None), None)
            if failed is not None:
                raise failed
            waiting = [s for s in sides if s.state == "waiting"]
            if len(waiting) == 2:
                record: list[tuple[int, int, int, float, float]] = []
                replies = fused_train_step([s.model for s in sides], [s.args for s in sides], orders, record)
                passes += [[fused, *p] for p in record]
                for s, r in zip(sides, replies):
                    s.reply = r
                fused += 1
            elif waiting:  # the other call ended: this step has nothing to fuse with
                s = waiting[0]
                a = s.args
                assert a is not None
                s.reply = type(s.model).train_step(s.model, a.micro_batches, a.loss_fn, a.optimizer,
                                                   max_grad_norm=a.max_grad_norm, loss_weights=a.loss_weights,
                                                   recompute=a.recompute)
                alone += 1
            else:
                break
    finally:
        for s in sides:  # a failure: end the calls still waiting in a train step
            if s.state == "waiting":
                s.abort = True
                s.resume()
        for s in sides:
            if s.thread.is_alive():
                s.thread.join()
    log.info("%s + %s: %d optimizer steps of each fused%s", first, second, fused,
             f", {alone} unfused (the calls took different numbers of steps)" if alone else "")
    write_passes(worker.run_dir, worker.rank, req, passes)
    (stats_a, metas_a), (stats_b, metas_b) = sides[0].result, sides[1].result
    return {**stats_a, **{protocol.FUSED_SECOND_STATS + k: v for k, v in stats_b.items()}}, metas_a + metas_b
