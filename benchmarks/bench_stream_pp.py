"""A streaming generation's decode at pp 2 (models/stream_pipeline.py) against the plain pipelined generation.

Two gloo processes (one thread each) hold the two stages of one replica. Per round, interleaved: the plain
``generate`` (micro-batches pipelined, at most pp in flight), the split generation decoded to the end without a split
point (every micro-batch in flight, each step's tokens on every stage before the next step), and the split
generation stopped at one split point and continued (``until`` + ``finish``, as a stream's two requests). Sampled
decoding of ``--rows`` prompts, ``--new-tokens`` new tokens each (every row to the end: no EOS), ``--n-mbs``
micro-batches. The table: seconds per call (median over rounds) and the ratio to the plain generation, beside the
estimator's (``estimator/call_time.generate_varied`` for the plain call, ``estimator/pp_stream_cost.stepped_generation``
for the split one; the CPU profile of ``--model``, with ``--profiles`` a folder of other tables).

    .venv/bin/python benchmarks/bench_stream_pp.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine_workers  # beside this script


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, results) -> None:
    engine_workers.start(rank, world, store, "cpu")
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.sampling import GenerationConfig
    from realloc.models.stream_decode import SplitGeneration

    cfg = get_model_config(args.model)
    cache, (layout,) = engine_workers.model_layouts(cfg, [(1, 1, 2)], world)
    model = ParallelModel(cfg, cache.model_groups(layout), seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (args.prompt,), generator=g) for _ in range(args.rows)]
    gc = GenerationConfig(max_new_tokens=args.new_tokens, seed=3, eos_token_ids=(), temperature=1.0)

    def plain():
        model.generate([p.tolist() for p in prompts], gc, seq_ids=range(args.rows), n_mbs=args.n_mbs)

    def split(stop: bool):
        gen = SplitGeneration(model, prompts, gc, range(args.rows), args.n_mbs)
        if stop:  # rows never end early here: a split point after half the steps
            gen.until(lambda n: 0 if gen.t >= args.new_tokens // 2 else n, 0)
        gen.finish()

    cases = {"plain pipelined": plain, "split, no split point": lambda: split(False),
             "split, one split point": lambda: split(True)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for name, fn in cases.items():  # warm-up
        fn()
    for _ in range(args.rounds):
        for name, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        stat = min if args.stat == "min" else statistics.median
        results.update({k: stat(v) for k, v in times.items()})
    dist.destroy_process_group()


def estimates(args: argparse.Namespace) -> dict[str, float]:
    """The estimator's seconds of each case: the plain pipelined generation and the stepped one (no call overhead:
    the benchmark times the decoding alone, and a dp-1 split point counts locally)."""
    import dataclasses

    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.estimator.pp_stream_cost import stepped_generation
    from realloc.graph.dataflow import build_graph
    from realloc.models.config import get_model_config
    from realloc.strategy import ParallelStrategy

    spec = load_experiment("experiments/ppo_tiny.py")
    graph = build_graph(dataclasses.replace(spec, prompt_len=args.prompt, gen_len=args.new_tokens))
    model = CostModel(graph, **({"profiles_root": args.profiles} if args.profiles else {}))
    timer = model._timer(get_model_config(args.model), model.call_precision("actor_gen"))
    s = ParallelStrategy(1, 1, 2)
    links = model.links(next(m for m in model.cluster.device_meshes() if m.size == 2), s)
    b, slots = args.rows // args.n_mbs, args.prompt + args.new_tokens
    ends = (args.new_tokens,) * b
    plain = timer.generate_varied(s, links, b, args.prompt, ends, args.n_mbs, slots=slots).time
    split = stepped_generation(timer, s, links, b, args.prompt, ends, args.n_mbs, slots)
    return {"plain pipelined": plain, "split, no split point": split, "split, one split point": split}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--n-mbs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profiles", default=None, help="a folder of profile tables (default: the shipped ones)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="over the rounds (min: the least disturbed round, on a loaded machine)")
    args = ap.parse_args()
    est = estimates(args)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TMPDIR", tmp)
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), args, results), nprocs=2)
        rows = dict(results)
    print(f"model={args.model} pp=2 rows={args.rows} prompt={args.prompt} new_tokens={args.new_tokens} "
          f"n_mbs={args.n_mbs} rounds={args.rounds} ({args.stat})")
    base = rows["plain pipelined"]
    print(f"{'decode':<26}{'s/call':>10}{'vs plain':>10}{'est. s':>10}{'est. vs plain':>15}{'est/meas':>10}")
    for name, t in rows.items():
        e = est[name]
        print(f"{name:<26}{t:>10.3f}{t / base:>10.2f}{e:>10.3f}{e / est['plain pipelined']:>15.2f}{e / t:>10.2f}")


if __name__ == "__main__":
    main()
