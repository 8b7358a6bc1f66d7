"""Long-tailed response lengths (issue 31): measured against estimated, and token-balanced dp ranks.

1. On this CPU (one gloo process, one thread; seconds of its CPU time, so that other processes on a shared box
   do not count): generation of a batch whose lengths follow a seeded long-tailed
   schedule (``length_schedule``, lognormal with p99 = 16x the median) next to the same batch at fixed
   length gen_len, and the inference forward of both outputs (packed), measured and estimated
   (``CostModel`` with this repository's CPU profile of the model, priced with the schedule's
   ``response_lengths``).
2. Token-balanced dp shares (``graph/row_balance.py``) of 512 lognormal responses: max/min tokens per rank
   against the even split.
3. The dry-run estimate of experiments/ppo_7b_7b.py's calls at their fastest placement with fixed lengths
   against lognormal lengths of median gen_len / 16 and p99 gen_len.

    .venv/bin/python benchmarks/bench_lengths.py [--rows 32 --gen-len 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch

import engine_workers  # beside this script
from realloc.api import GENERATE, INFERENCE, ModelFunctionCallDef, auto, experiment_spec, load_experiment
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.graph.row_balance import rank_tokens, token_balanced_ranges
from realloc.graph.row_deal import deal_rows, worst_ratio
from realloc.graph.transfer_plan import dp_ranges
from realloc.lengths import ResponseLengths
from realloc.models.length_schedule import scheduled_lengths
from realloc.search.build import PlanSpace
from realloc.strategy import ParallelStrategy


def _spec(args: argparse.Namespace, lengths: ResponseLengths):
    @auto(nodelist="localhost", n_devices_per_node=1, device="cpu", batch_size=args.rows, prompt_len=args.prompt,
          gen_len=args.gen_len, response_lengths=lengths)
    @dataclasses.dataclass
    class Lengths:
        @property
        def rpcs(self):
            return [ModelFunctionCallDef(name="gen", model_name="actor", model_type=args.model,
                                         interface_type=GENERATE, interface_impl="ppo_actor",
                                         input_data=["prompts"], output_data=["seq", "logp"]),
                    ModelFunctionCallDef(name="inf", model_name="ref", model_type=args.model,
                                         interface_type=INFERENCE, interface_impl="ppo_actor",
                                         input_data=["seq"], output_data=["ref_logp"])]

    return experiment_spec(Lengths)


def measured_vs_estimated(args: argparse.Namespace) -> None:
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.sampling import GenerationConfig

    with tempfile.TemporaryDirectory() as tmp:
        device = engine_workers.start(0, 1, os.path.join(tmp, "store"), "cpu")
        cfg = get_model_config(args.model)
        cache, (layout,) = engine_workers.model_layouts(cfg, [(1, 1, 1)], 1)
        model = ParallelModel(cfg, cache.model_groups(layout), device=device, seed=1)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, cfg.vocab_size, (args.rows, args.prompt), generator=g).tolist()
        tail = ResponseLengths.lognormal(median=args.gen_len / 16, p99=args.gen_len)
        eos = (cfg.vocab_size - 1,)
        configs = {"fixed": GenerationConfig(max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, seed=3),
                   "long tail": GenerationConfig(max_new_tokens=args.gen_len, seed=3, eos_token_ids=eos,
                                                 length_schedule=tail)}
        rows = []
        for name, gc in configs.items():
            model.generate(prompts[:2], dataclasses.replace(gc, max_new_tokens=4, min_new_tokens=0))  # warm-up
            t0 = time.process_time()
            out = model.generate(prompts, gc, n_mbs=1)
            gen_s = time.process_time() - t0
            batch = {"input_ids": out.sequences, "lengths": out.lengths}
            model.forward(batch)
            t0 = time.process_time()
            for _ in range(args.repeats):
                model.forward(batch)
            inf_s = (time.process_time() - t0) / args.repeats
            lengths = ResponseLengths.fixed() if name == "fixed" else tail
            cost = CostModel(build_graph(_spec(args, lengths)))
            mesh = cost.cluster.whole
            s = ParallelStrategy(1, 1, 1)
            est_gen, est_inf = cost.call_cost("gen", mesh, s, 1).time, cost.call_cost("inf", mesh, s, 1).time
            gen_lens = out.gen_lengths.tolist()
            rows.append((name, sorted(gen_lens)[len(gen_lens) // 2], max(gen_lens), gen_s, est_gen, inf_s, est_inf))
        dist_done()
    print(f"{args.rows} rows of {args.prompt} prompt tokens, at most {args.gen_len} generated, model {args.model}, "
          f"1 CPU thread; long tail = lognormal median {args.gen_len / 16:g}, p99 {args.gen_len}")
    print(f"{'lengths':<10}{'median':>7}{'max':>5}{'gen s':>9}{'est':>9}{'est/meas':>9}{'inf s':>9}{'est':>9}"
          f"{'est/meas':>9}")
    for name, med, mx, gs, eg, i_s, ei in rows:
        print(f"{name:<10}{med:>7}{mx:>5}{gs:>9.3f}{eg:>9.3f}{eg / gs:>9.2f}{i_s:>9.4f}{ei:>9.4f}{ei / i_s:>9.2f}")
    (_, _, _, gf, egf, i_f, eif), (_, _, _, gt, egt, i_t, eit) = rows
    print(f"fixed / long tail: generation measured {gf / gt:.2f}x, estimated {egf / egt:.2f}x; "
          f"inference measured {i_f / i_t:.2f}x, estimated {eif / eit:.2f}x")


def dist_done() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def balance_table() -> None:
    tail = ResponseLengths.lognormal(median=64, p99=1024)
    tokens = [32 + n for n in scheduled_lengths(tail, 2048, seed=0, seq_ids=range(512))]
    print("512 responses, 32 prompt tokens + lognormal(median 64, p99 1024) of at most 2048: max/min tokens per dp rank")
    print(f"{'dp':>4}{'even rows':>11}{'contiguous':>12}{'row lists':>11}  (balance_tokens: row lists)")
    for dp in (2, 4, 8):
        even, bal = rank_tokens(tokens, dp_ranges(512, dp)), rank_tokens(tokens, token_balanced_ranges(tokens, dp))
        print(f"{dp:>4}{max(even) / min(even):>11.3f}{max(bal) / min(bal):>12.3f}"
              f"{worst_ratio(tokens, deal_rows(tokens, dp)):>11.3f}")


def dry_run() -> None:
    spec = load_experiment("experiments/ppo_7b_7b.py")
    tail = ResponseLengths.lognormal(median=spec.gen_len / 16, p99=spec.gen_len)
    best = {}
    for name, lengths in (("fixed", ResponseLengths.fixed()), ("long tail", tail)):
        space = PlanSpace.build(build_graph(dataclasses.replace(spec, response_lengths=lengths)))
        best[name] = {c: float(k.time.min()) for c, k in zip(space.problem.call_names, space.problem.candidates)}
    print(f"{spec.name}: fastest placement of each call, estimated seconds; long tail = lognormal median "
          f"{spec.gen_len / 16:g}, p99 {spec.gen_len} of at most {spec.gen_len}")
    print(f"{'call':<14}{'fixed':>9}{'long tail':>11}{'ratio':>8}")
    for c in best["fixed"]:
        print(f"{c:<14}{best['fixed'][c]:>9.2f}{best['long tail'][c]:>11.2f}{best['fixed'][c] / best['long tail'][c]:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    measured_vs_estimated(args)
    print()
    balance_table()
    print()
    dry_run()


if __name__ == "__main__":
    main()
