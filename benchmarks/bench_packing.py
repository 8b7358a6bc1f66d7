"""Sequence packing against padded rows: tokens per second of forward() and train_step() (issue 21, item 6).

Sequence lengths are log-uniform between seq/8 and seq (they vary 1-8x, many short ones, like responses
generated to EOS). The calls see what the algorithms hand them: one global batch right-padded to its
longest sequence, split by rows into micro-batches. The same model runs it with ``pack_sequences`` on
and off in each layout, so the ratio compares the two on the same machine in one run. Tokens per second
count real tokens only (padding is work, not output).

    .venv/bin/python benchmarks/bench_packing.py --world 2
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine_workers  # beside this script

LAYOUTS = [(1, 2, 1), (1, 1, 2)]


def skewed_batch(vocab: int, rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows with log-uniform lengths in [seq/8, seq]; the longest is seq."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=g)
    lens = torch.exp(math.log(seq / 8) + u * math.log(8)).round().long().clamp(1, seq)
    lens[0] = seq
    mask = torch.arange(seq)[None] < lens[:, None]
    ids = torch.randint(1, vocab, (rows, seq), generator=g) * mask
    return {"input_ids": ids, "lengths": lens}


def _timed(fn, group) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results) -> None:
    device = engine_workers.start(rank, world, store, args.device)
    from realloc.models.batch import split_batch
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel

    cfg = get_model_config(args.model)
    cache, layouts = engine_workers.model_layouts(cfg, LAYOUTS, world)
    batch = skewed_batch(cfg.vocab_size, args.rows, args.seq, seed=0)
    tokens = int(batch["lengths"].sum())
    for lay in layouts:
        row: dict[str, float] = {}
        if rank in lay.device_ids:
            model = ParallelModel(cfg, cache.model_groups(lay), device=device, seed=1)
            mesh = model.groups.mesh_group
            opt = torch.optim.SGD(list(model.params().values()), lr=0.0)  # the step's cost, weights unchanged
            mbs = split_batch(batch, args.n_mbs)
            calls = {"forward": lambda: model.forward(batch, n_mbs=args.n_mbs),
                     "train": lambda: model.train_step(mbs, engine_workers.nll_loss, opt)}
            best: dict[str, float] = {}
            # Padded and packed alternate, and each keeps its fastest run: on a shared machine a slow
            # moment then hits both, and the first run of each (warm-up) is not timed.
            for r in range(args.repeats + 1):
                for pack in (False, True):
                    model.pack_sequences = pack
                    for call, fn in calls.items():
                        dt = _timed(fn, mesh)
                        key = f"{call} {'packed' if pack else 'padded'}"
                        if r > 0:
                            best[key] = min(best.get(key, math.inf), dt)
            row = {k: tokens / dt for k, dt in best.items()}
            del model, opt
        keys = ["forward padded", "forward packed", "train padded", "train packed"]
        # Every process joins; the layout's slowest rank defines its time.
        vals = torch.tensor([1.0 / row.get(k, float("inf")) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        if rank == 0:
            results[str(lay.strategy)] = [1.0 / float(v) for v in vals]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rows", type=int, default=32, help="sequences per call (the whole batch)")
    ap.add_argument("--seq", type=int, default=128, help="the longest sequence; the shortest are seq/8")
    ap.add_argument("--n-mbs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each call and mode (fastest kept)")
    args = ap.parse_args()

    from realloc.models.batch import split_rows, token_layout, trim
    from realloc.models.config import get_model_config
    from realloc.models.packing import pack_layout

    batch = skewed_batch(get_model_config(args.model).vocab_size, args.rows, args.seq, seed=0)
    lay = token_layout(batch)
    slots = 0
    for lo, hi in split_rows(lay, args.n_mbs):
        part = trim(type(lay)(lay.input_ids[lo:hi], lay.position_ids[lo:hi], lay.segment_ids[lo:hi]))[0]
        plan = pack_layout(part)
        slots += part.input_ids.numel() if plan is None else plan.layout.input_ids.numel()
    tokens = int(batch["lengths"].sum())
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TMPDIR", tmp)
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(args.world, os.path.join(tmp, "store"), args, results), nprocs=args.world)
        rows = dict(results)

    print(f"model={args.model} world={args.world} device={args.device}: {args.rows} sequences of {args.seq // 8}-"
          f"{args.seq} tokens (log-uniform), {tokens} tokens; padded {args.rows * args.seq} slots, packed {slots} "
          f"({args.n_mbs} micro-batches); tokens/s of real tokens, fastest of {args.repeats} runs")
    head = (f"{'layout':<12}{'fwd padded':>12}{'fwd packed':>12}{'ratio':>7}"
            f"{'train padded':>14}{'train packed':>14}{'ratio':>7}")
    print(head)
    print("-" * len(head))
    for name, (fp, fk, tp, tk) in rows.items():
        print(f"{name:<12}{fp:>12.0f}{fk:>12.0f}{fk / fp:>7.2f}{tp:>14.0f}{tk:>14.0f}{tk / tp:>7.2f}")


if __name__ == "__main__":
    main()
