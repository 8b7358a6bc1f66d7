"""Activation recomputation and pipelined generation on the local CPU cluster, next to the estimator.

    .venv/bin/python benchmarks/bench_scale.py                        # both sections (~3 min)
    .venv/bin/python benchmarks/bench_scale.py --only recompute       # or: --only generation

Two gloo processes (one thread each, the two CPU devices of experiments/ppo_small.py) run the
``small`` model (8 layers, hidden 256, fp32):

1. recompute: ``train_step`` of 4 micro-batches x 8 sequences x 128 tokens in (1, 1, 1) and
   (1, 1, 2), with and without activation recomputation. Measured: the peak bytes autograd keeps
   for the backward on each stage (``SavedTensorMeter``), the peak of every tensor the step creates
   in bf16, temporaries included, less its fp32 main_grad buffers (``LiveTensorMeter``), and the
   step time (median, fp32); estimated: ``memory.train_saved_bytes``, ``memory.train_activation_bytes``
   and ``CallTimer.train_step`` from profiles/cpu/small.json.
2. generation: ``generate`` of 32 prompts of 8 tokens + 24 new ones (no EOS), pp = 1 with 1
   micro-batch and pp = 2 with 1, 2 and 4 micro-batches. pp = 2 with one micro-batch is the
   schedule generation had before pipelining (the stages take turns on the whole batch).
   Estimated: ``CallTimer.generate``.

Timings are medians of ``--repeats`` runs after a warm-up, the variants of one layout interleaved;
read the load average printed next to them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "small"
TRAIN = dict(n_mbs=4, rows=8, seq=128)
TRAIN_LAYOUTS = ((1, 1, 1), (1, 1, 2))
GEN = dict(prompts=64, prompt_len=8, gen_len=24)
GEN_CASES = ((1, 2), (2, 1), (2, 2), (2, 4))  # (pp, micro-batches)


def _loss(out, mb):
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / mask.sum(), {}


def _median_times(fns, repeats: int, group) -> list[float]:
    """Median seconds of each of ``fns``, run in turn ``repeats`` times after a warm-up: interleaved, so that a
    busy phase of the shared machine slows every variant alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a call ends when its slowest rank does
    return [statistics.median(row) for row in t.tolist()]


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from realloc.models.activations import LiveTensorMeter, SavedTensorMeter
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.models.sampling import GenerationConfig
    from realloc.strategy import ParallelStrategy

    cfg = get_model_config(MODEL)
    cache = ProcessGroupCache()
    pps = sorted({pp for _, _, pp in TRAIN_LAYOUTS} | {pp for pp, _ in GEN_CASES})
    layouts = {pp: ModelLayout.for_model(cfg, tuple(range(pp)), ParallelStrategy(1, 1, pp)) for pp in pps}
    cache.ensure_layouts(list(layouts.values()))
    out = {}
    g = torch.Generator().manual_seed(0)
    for pp, lay in layouts.items():
        if rank not in lay.device_ids:
            continue
        model = ParallelModel(cfg, cache.model_groups(lay), seed=1)
        mesh = model.groups.mesh_group
        if "recompute" in args.only and (1, 1, pp) in TRAIN_LAYOUTS:
            mbs = [{"input_ids": torch.randint(0, cfg.vocab_size, (TRAIN["rows"], TRAIN["seq"]), generator=g),
                    "lengths": torch.full((TRAIN["rows"],), TRAIN["seq"])} for _ in range(TRAIN["n_mbs"])]
            opt = model.make_optimizer(lr=1e-6)
            saved = {}
            for rc in (False, True):
                with SavedTensorMeter(model.params().values()) as meter:
                    model.train_step(mbs, _loss, opt, recompute=rc)
                saved[rc] = meter.peak
            steps = [lambda rc=rc: model.train_step(mbs, _loss, opt, recompute=rc) for rc in (False, True)]
            for rc, dt in zip((False, True), _median_times(steps, args.repeats, mesh)):
                out["train", pp, model.groups.pp_rank, rc] = (saved[rc], dt)
            # every tensor, temporaries included, of a bf16 step (the GPUs' precision); its fp32 main_grad
            # buffers are static memory in the memory model
            low = ParallelModel(cfg, cache.model_groups(lay), dtype=torch.bfloat16, seed=1)
            low_opt = low.make_optimizer(lr=1e-6)
            low.train_step(mbs, _loss, low_opt)  # the optimizer's state exists before the measured steps
            main_grads = sum(p.numel() for p in low.params().values()) * 4
            for rc in (False, True):
                with LiveTensorMeter() as live:
                    low.train_step(mbs, _loss, low_opt, recompute=rc)
                out["live", pp, low.groups.pp_rank, rc] = live.peak - main_grads
            del low, low_opt
        if "generation" in args.only:
            prompts = torch.randint(1, cfg.vocab_size, (GEN["prompts"], GEN["prompt_len"]), generator=g).tolist()
            gcfg = GenerationConfig(max_new_tokens=GEN["gen_len"], seed=3)
            cases = [n_mbs for case_pp, n_mbs in GEN_CASES if case_pp == pp]
            runs = [lambda n=n: model.generate(prompts, gcfg, n_mbs=n) for n in cases]
            for n_mbs, dt in zip(cases, _median_times(runs, args.repeats, mesh)):
                out["gen", pp, n_mbs] = dt
    results[rank] = out
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict:
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_worker, args=(world, store, args, results), nprocs=world, join=True)
        merged = {}
        for r in range(world):
            merged.update(results[r])
        return merged


def estimator():
    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.models.config import get_model_config

    graph = build_graph(load_experiment("experiments/ppo_small.py"))
    cost = CostModel(graph)
    cfg = get_model_config(MODEL)
    return cost, cost._timer(cfg), cfg


def report_recompute(m: dict) -> None:
    from realloc.estimator.memory import train_saved_bytes
    from realloc.strategy import ParallelStrategy as S

    cost, timer, cfg = estimator()
    mib = 2**20
    n_tok = TRAIN["rows"] * TRAIN["seq"]
    print(f"\n== activation recomputation: {MODEL}, train_step of {TRAIN['n_mbs']} micro-batches x {TRAIN['rows']} "
          f"x {TRAIN['seq']} tokens; layer costs from {timer.costs.source} ==")
    print(f"{'layout':<10}{'stage':>6}{'saved MiB':>11}{'w/ recomp':>11}{'saved':>8}{'est. MiB':>10}{'w/ recomp':>11}"
          f"{'est. saved':>12}")
    for dp, tp, pp in TRAIN_LAYOUTS:
        s = S(dp, tp, pp)
        for k in range(pp):
            full, redo = m["train", pp, k, False][0], m["train", pp, k, True][0]
            ef, er = (train_saved_bytes(cfg, s, TRAIN["n_mbs"], k, n_tok, cost.precision, rc) for rc in (False, True))
            print(f"{str((dp, tp, pp)):<10}{k:>6}{full / mib:>11.1f}{redo / mib:>11.1f}{1 - redo / full:>8.0%}"
                  f"{ef / mib:>10.1f}{er / mib:>11.1f}{1 - er / ef:>12.0%}")
    from realloc.estimator.hardware import Precision
    from realloc.estimator.memory import train_activation_bytes

    bf16 = Precision.for_dtype("bf16")
    print(f"\nall tensors of a bf16 step, temporaries included (main_grad buffers excluded)")
    print(f"{'layout':<10}{'stage':>6}{'peak MiB':>10}{'w/ recomp':>11}{'saved':>8}{'est. MiB':>10}{'w/ recomp':>11}"
          f"{'est. saved':>12}{'est./meas.':>12}")
    for dp, tp, pp in TRAIN_LAYOUTS:
        s = S(dp, tp, pp)
        for k in range(pp):
            full, redo = m["live", pp, k, False], m["live", pp, k, True]
            ef, er = (train_activation_bytes(cfg, s, TRAIN["n_mbs"], k, n_tok, bf16, rc) for rc in (False, True))
            print(f"{str((dp, tp, pp)):<10}{k:>6}{full / mib:>10.1f}{redo / mib:>11.1f}{1 - redo / full:>8.0%}"
                  f"{ef / mib:>10.1f}{er / mib:>11.1f}{1 - er / ef:>12.0%}{ef / full:>7.2f}/{er / redo:.2f}")
    print(f"\n{'layout':<10}{'s/step':>9}{'w/ recomp':>11}{'time paid':>11}{'est. s':>9}{'w/ recomp':>11}"
          f"{'est. paid':>11}")
    for dp, tp, pp in TRAIN_LAYOUTS:
        s = S(dp, tp, pp)
        mesh = cost.cluster.whole if pp == 2 else cost.cluster.mesh("localhost:0")
        links = cost.links(mesh, s)
        t0, t1 = m["train", pp, 0, False][1], m["train", pp, 0, True][1]
        e0, e1 = (timer.train_step(s, links, TRAIN["rows"], TRAIN["seq"], TRAIN["n_mbs"], rc).time
                  for rc in (False, True))
        print(f"{str((dp, tp, pp)):<10}{t0:>9.3f}{t1:>11.3f}{t1 / t0 - 1:>+11.0%}{e0:>9.3f}{e1:>11.3f}"
              f"{e1 / e0 - 1:>+11.0%}")


def report_generation(m: dict) -> None:
    from realloc.strategy import ParallelStrategy as S

    cost, timer, _ = estimator()
    print(f"\n== generation: {MODEL}, {GEN['prompts']} prompts x {GEN['prompt_len']} tokens + {GEN['gen_len']} new; "
          f"pp = 2 with 1 micro-batch is the schedule before pipelining ==")
    print(f"{'pp':>3}{'mbs':>5}{'measured s':>12}{'est. s':>9}{'error':>8}{'vs pp=2, 1 mb':>15}{'est.':>7}"
          f"{'vs pp=1':>9}{'est.':>7}")
    est = {}
    for pp, n_mbs in GEN_CASES:
        mesh = cost.cluster.whole if pp == 2 else cost.cluster.mesh("localhost:0")
        s = S(1, 1, pp)
        est[pp, n_mbs] = timer.generate(s, cost.links(mesh, s), -(-GEN["prompts"] // n_mbs), GEN["prompt_len"],
                                        GEN["gen_len"], n_mbs).time
    for pp, n_mbs in GEN_CASES:
        t, e = m["gen", pp, n_mbs], est[pp, n_mbs]
        print(f"{pp:>3}{n_mbs:>5}{t:>12.3f}{e:>9.3f}{e / t - 1:>+8.1%}{m['gen', 2, 1] / t:>14.2f}x"
              f"{est[2, 1] / e:>6.2f}x{m['gen', 1, 2] / t:>8.2f}x{est[1, 2] / e:>6.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["recompute", "generation"], action="append")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    args.only = tuple(args.only or ("recompute", "generation"))
    print(f"load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    m = measure(args)
    print(f"load after:  {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    if "recompute" in args.only:
        report_recompute(m)
    if "generation" in args.only:
        report_generation(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
