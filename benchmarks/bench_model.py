"""Throughput of the parallel model per layout: inference forward, train step, and generation.

Runs N gloo processes on this machine (one thread each) and, for each (dp, tp, pp)
layout that fits, times the three calls the runtime makes, in tokens per second of
the whole layout. A dense HuggingFace LlamaForCausalLM of the same shape, timed in
the parent process with one thread, is the reference column. On a CPU box with
fewer cores than processes the absolute numbers mostly show overheads (p2p,
all-reduce, pipeline bubbles); the same script runs on GPUs with --device cuda
(one process per GPU, NCCL).

    .venv/bin/python benchmarks/bench_model.py --model small --world 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine_workers  # beside this script

LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4)]


def _batch(cfg, rows: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=g)
    return {"input_ids": ids, "lengths": torch.full((rows,), seq)}


def _timed(fn, repeats: int, group) -> float:
    fn()  # warm-up
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier(group=group)
    return (time.perf_counter() - t0) / repeats


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results) -> None:
    device = engine_workers.start(rank, world, store, args.device)
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.sampling import GenerationConfig

    cfg = get_model_config(args.model)
    cache, layouts = engine_workers.model_layouts(cfg, LAYOUTS, world)
    world_group = dist.group.WORLD
    for lay in layouts:
        s = lay.strategy
        row = {}
        if rank in lay.device_ids:
            model = ParallelModel(cfg, cache.model_groups(lay), device=device, seed=1)
            g = model.groups
            mesh = g.mesh_group
            # Global batch fixed per call; each dp replica takes its share.
            fwd = _batch(cfg, args.rows // s.dp, args.seq, seed=g.dp_rank)
            n_mbs = max(1, min(args.rows // s.dp, 2 * s.pp))
            dt = _timed(lambda: model.forward(fwd, n_mbs=n_mbs), args.repeats, mesh)
            row["forward"] = args.rows * args.seq / dt
            opt = model.make_optimizer(lr=1e-5)
            mbs = [_batch(cfg, args.rows // s.dp // 4, args.seq, seed=10 * g.dp_rank + i) for i in range(4)]
            dt = _timed(lambda: model.train_step(mbs, engine_workers.nll_loss, opt, max_grad_norm=1.0), args.repeats,
                        mesh)
            row["train"] = args.rows * args.seq / dt
            prompts = _batch(cfg, args.gen_rows // s.dp, args.prompt, seed=g.dp_rank)["input_ids"].tolist()
            gc = GenerationConfig(max_new_tokens=args.new_tokens, greedy=True)
            dt = _timed(lambda: model.generate(prompts, gc), 1, mesh)
            row["generate"] = args.gen_rows * args.new_tokens / dt
            del model, opt
        # Every process joins the reduction; the layout's slowest rank defines its time.
        vals = torch.tensor([1.0 / row.get(k, float("inf")) for k in ("forward", "train", "generate")],
                            dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=world_group)
        if rank == 0:
            results[str(s)] = [1.0 / float(v) for v in vals]
    dist.destroy_process_group()


def _hf_reference(args: argparse.Namespace) -> list[float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from realloc.models.config import get_model_config
    from realloc.models.hf_io import hf_config_from_model_config

    torch.set_num_threads(1)
    cfg = get_model_config(args.model)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_from_model_config(cfg), attn_implementation="sdpa")).eval()
    ids = _batch(cfg, args.rows, args.seq)["input_ids"]

    def fwd():
        with torch.no_grad():
            hf(ids)

    def train():
        hf.zero_grad()
        for chunk in ids.chunk(4):
            out = hf(chunk, labels=chunk)
            (out.loss / 4).backward()

    prompts = _batch(cfg, args.gen_rows, args.prompt)["input_ids"]

    def gen():
        with torch.no_grad():
            hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    out = []
    for fn, tokens, reps in ((fwd, args.rows * args.seq, args.repeats), (train, args.rows * args.seq, args.repeats),
                             (gen, args.gen_rows * args.new_tokens, 1)):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append(tokens * reps / (time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rows", type=int, default=16, help="sequences per forward / train step (global)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--gen-rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    ref = _hf_reference(args)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TMPDIR", tmp)
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(args.world, os.path.join(tmp, "store"), args, results), nprocs=args.world)
        rows = dict(results)

    print(f"model={args.model} world={args.world} device={args.device} forward/train: {args.rows}x{args.seq} tokens, "
          f"generate: {args.gen_rows} prompts x {args.new_tokens} new tokens (greedy)")
    head = f"{'layout':<16}{'forward tok/s':>15}{'vs HF':>8}{'train tok/s':>14}{'vs HF':>8}{'generate tok/s':>16}{'vs HF':>8}"
    print(head)
    print("-" * len(head))
    print(f"{'HF dense (1 thr)':<16}{ref[0]:>15.0f}{1:>8.2f}{ref[1]:>14.0f}{1:>8.2f}{ref[2]:>16.0f}{1:>8.2f}")
    for name, (f, t, g) in rows.items():
        print(f"{name:<16}{f:>15.0f}{f / ref[0]:>8.2f}{t:>14.0f}{t / ref[1]:>8.2f}{g:>16.0f}{g / ref[2]:>8.2f}")


if __name__ == "__main__":
    main()
