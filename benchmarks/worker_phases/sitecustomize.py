"""Where a worker's call time goes: thread CPU time of each call's request, of the engine calls inside it and of the
data store, with its minor page faults and kernel time (issue 31; docs/estimator.md, "Host work a table
measures"). Measurement only: nothing of it is part of realloc.

Python imports ``sitecustomize`` at start-up from the path, so with this folder first on PYTHONPATH every worker of
a run loads it; with ``REALLOC_PHASES_DIR`` set, a worker wraps its request handler once its module is imported and
writes ``DIR/w<rank>.json`` at shutdown (per call: totals over iterations 2.. and the number of requests; the
request's wall time too, and the blocking collectives' count, wall and thread CPU time, docs/estimator.md, "Waits at
dp > 1"):

    PYTHONPATH=$PWD/benchmarks/worker_phases:$PWD REALLOC_PHASES_DIR=/tmp/phases \\
        .venv/bin/python -m realloc run EXP --plan PLAN --iterations 8 --no-final-checkpoint --quiet
"""

from __future__ import annotations

import builtins
import os
import sys

WORKER = "realloc.runtime.control.worker"


def _install() -> None:
    import collections
    import json
    import pathlib
    import resource
    import time

    from realloc.models.engine import ParallelModel
    from realloc.runtime.control import worker
    from realloc.runtime.transfer.data_store import DataStore
    from realloc.runtime.wire import protocol

    acc: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    current: list[str] = []

    def timed(cls: type, name: str, label: str) -> None:
        orig = getattr(cls, name)

        def wrapped(*a, **k):
            c = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                if current:
                    acc[current[0]][label] += time.thread_time() - c
        setattr(cls, name, wrapped)

    for name in ("forward", "train_step", "generate"):
        timed(ParallelModel, name, f"engine.{name}")
    import torch.distributed as dist

    def collective(name: str) -> None:
        orig = getattr(dist, name)

        def wrapped(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                if current:
                    acc[current[0]]["collectives"] += 1
                    acc[current[0]]["collective_wall"] += time.perf_counter() - t
                    acc[current[0]]["collective_cpu"] += time.thread_time() - c
        setattr(dist, name, wrapped)

    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single", "all_gather", "broadcast"):
        collective(name)
    timed(DataStore, "get_rows", "store.get_rows")
    timed(DataStore, "put_rows", "store.put_rows")
    handle = worker.ModelWorker.handle

    def phases(self, req):
        if not (isinstance(req, protocol.RunCall) and req.iteration >= 1):  # 0-based: iterations 2..
            if isinstance(req, protocol.Shutdown):
                out = pathlib.Path(os.environ["REALLOC_PHASES_DIR"])
                out.mkdir(parents=True, exist_ok=True)
                (out / f"w{self.rank}.json").write_text(json.dumps(acc, indent=1))
            return handle(self, req)
        current.append(req.call)
        r0, c, t = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time(), time.perf_counter()
        try:
            return handle(self, req)
        finally:
            r1, a = resource.getrusage(resource.RUSAGE_THREAD), acc[req.call]
            a["requests"] += 1
            a["request"] += time.thread_time() - c
            a["request_wall"] += time.perf_counter() - t
            a["page_faults"] += r1.ru_minflt - r0.ru_minflt
            a["kernel"] += r1.ru_stime - r0.ru_stime
            current.clear()
    worker.ModelWorker.handle = phases


if os.environ.get("REALLOC_PHASES_DIR"):
    _import = builtins.__import__

    def _watch(name, *a, **k):
        module = _import(name, *a, **k)
        mod = sys.modules.get(WORKER)
        if mod is not None and hasattr(mod, "main"):  # the worker module is complete: wrap it once
            builtins.__import__ = _import
            _install()
        return module
    builtins.__import__ = _watch
