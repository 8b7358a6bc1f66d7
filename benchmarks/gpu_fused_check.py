"""Section 'fused' of ``gpu_check.py``: a fused actor and critic train step on NCCL (issue 33, docs/fused-training.md).

    python benchmarks/gpu_check.py --out DIR --only fused      (or the whole check: it runs last)

Two processes, one GPU each, NCCL (four, at tp 2, where there are four GPUs): a ``tiny`` actor and a critic at
pp 2, the critic's stages in reverse order, from the same initial weights, two optimizer steps one model after
the other (each its own 1F1B ``train_step``), then the same two steps fused (``models/fused_train.py``: one
schedule from the schedule search, its point-to-point program from ``models/fused_protocol.py``). The section
reports whether the fused steps completed (a deadlock under NCCL shows as the section's timeout), the largest
difference of any parameter between the two (bit-equal on gloo, ``tests/test_fused_train.py``), and each
side's time. NCCL needs one GPU per process: on one GPU the section says so and runs nothing.
``--device cpu`` rehearses it on gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PAIR_TYPES = ("tiny", "tiny-critic")
STEPS = 2


def _batches(seed: int, n: int, rows: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens = torch.randint(4, 24, (rows,), generator=g)
        t = int(lens.max())
        mask = (torch.arange(t)[None] < lens[:, None]).long()
        out.append({"input_ids": torch.randint(1, vocab, (rows, t), generator=g) * mask, "lengths": lens,
                    "targets": torch.randn(rows, t, generator=g)})
    return out


def _nll(out, mb):
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / mask.sum(), {}


def _value(out, mb):
    valid = (out.layout.segment_ids >= 0).float()
    return (((out.values - mb["targets"]) ** 2) * valid).sum() / valid.sum(), {}


def _order(n_mbs: int) -> list:
    from realloc import _C

    prob = _C.FusedProblem(2, 2, n_mbs, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0], 2, n_mbs, [0.8, 0.8], [1.6, 1.6],
                           [1.0, 1.0])
    return prob.search(iterations=300, memory_iterations=100)["order"]


def _worker(rank: int, world: int, tp: int, n_mbs: int, store: str, device: str, out: "mp.Queue") -> None:
    try:
        out.put((rank, _run(rank, world, tp, n_mbs, store, device)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, {"error": traceback.format_exc()}))


def _run(rank: int, world: int, tp: int, n_mbs: int, store: str, device: str) -> dict[str, Any]:
    import engine_workers
    import torch.distributed as dist

    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.fused_train import TrainArgs, fused_train_step
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.strategy import ParallelStrategy

    dev = engine_workers.start(rank, world, store, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cfgs = [get_model_config(t) for t in PAIR_TYPES]
    ids = tuple(range(world))
    # the critic's stage 0 on the second stage group: its device order is the actor's with the halves swapped
    layouts = [ModelLayout.for_model(cfgs[0], ids, ParallelStrategy(1, tp, 2)),
               ModelLayout.for_model(cfgs[1], ids[tp:] + ids[:tp], ParallelStrategy(1, tp, 2))]
    cache = ProcessGroupCache()
    cache.ensure_layouts(layouts)
    order = _order(n_mbs)
    result: dict[str, Any] = {}
    params = {}
    for fused in (False, True):
        models = [ParallelModel(cfg, cache.model_groups(lay), device=dev, seed=3 + k)
                  for k, (cfg, lay) in enumerate(zip(cfgs, layouts))]
        opts = [m.make_optimizer(1e-3) for m in models]
        t0 = time.perf_counter()
        for step in range(STEPS):
            args = [TrainArgs(_batches(100 * step + k, n_mbs, 4, 64), loss, opt, max_grad_norm=1.0)
                    for k, (loss, opt) in enumerate(zip((_nll, _value), opts))]
            if fused:
                fused_train_step(models, args, order)
            else:
                for m, a in zip(models, args):
                    m.train_step(a.micro_batches, a.loss_fn, a.optimizer, max_grad_norm=a.max_grad_norm)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        result["fused_s" if fused else "serial_s"] = round(time.perf_counter() - t0, 3)
        params[fused] = [{n: p.detach().double().cpu() for n, p in m.params().items()} for m in models]
    worst = max((a[n] - b[n]).abs().max().item() for a, b in zip(params[False], params[True]) for n in a)
    result["max_param_diff"] = worst
    dist.destroy_process_group()
    return result


def fused_nccl(device: str, timeout: float = 300.0) -> dict[str, Any]:
    """The section's result: ``ok`` when every rank completed and the parameters agree within 1e-6."""
    n_gpus = torch.cuda.device_count() if device == "cuda" else 4
    if n_gpus < 2:
        return {"skipped": f"NCCL needs one GPU per process and this machine has {n_gpus}; the fused pair needs 2",
                "ok": True}
    tp = 2 if n_gpus >= 4 else 1
    world, n_mbs = 2 * tp, 4
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gpu-fused-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, tp, n_mbs, os.path.join(tmp, "store"), device, out),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world and time.monotonic() < deadline:
                try:
                    rank, res = out.get(timeout=1.0)
                    results[rank] = res
                except queue_mod.Empty:
                    if all(p.exitcode is not None for p in procs) and out.empty():
                        break
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    res: dict[str, Any] = {"world": world, "tp": tp, "pp": 2, "micro_batches": n_mbs, "models": list(PAIR_TYPES)}
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors or len(results) < world:
        res["error"] = errors[0] if errors else (f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                                 f"within {timeout:.0f} s: the fused step deadlocked or crashed")
        res["ok"] = False
        return res
    res.update(results[0])
    res["max_param_diff"] = max(r["max_param_diff"] for r in results.values())
    res["ok"] = res["max_param_diff"] <= 1e-6
    return res


if __name__ == "__main__":
    print(fused_nccl(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
