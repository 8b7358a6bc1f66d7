"""Lengths from EOS (issue 31): each call's estimate, priced with the response lengths of the previous iteration,
against its measured time, on a real run of experiments/arith_grpo_eos.py.

The run is the experiment's GRPO loop, executed in this one process on one device (the calls' own interface
functions: ``actor_generate``, ``actor_logprobs`` on the frozen reference, ``grpo_train``, the exact-match reward
in plain Python): the demo's SFT checkpoint samples 8 answers to each of 32 prompts and stops at its own EOS
(lengths 1-4 of at most 16), then learns. Measured: seconds of this process's CPU time
(``time.process_time``, one torch thread), so that other processes on a shared machine do not count; wall time
would. Estimated: ``CostModel`` of the experiment with ``response_lengths`` = the empirical distribution of the
previous iteration's responses (what ``realloc search --lengths-from RUN_DIR`` prices from a run's samples.jsonl),
on one device (dp = tp = pp = 1, one micro-batch), with a profile of the SFT checkpoint's own shape measured in
CPU time (``PROFILE``), beside the same estimate at fixed lengths (every response gen_len tokens, the estimator
without lengths) and the uncalibrated one (no shipped table matches the checkpoint: the roofline).

    .venv/bin/python benchmarks/bench_eos_lengths.py [--iterations 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

import engine_workers  # beside this script
from realloc.algorithms.common import actor_generate, actor_logprobs
from realloc.algorithms.context import CallContext
from realloc.algorithms.critic_free.critic_free import grpo_train
from realloc.api import load_experiment
from realloc.data.tokenizer import Tokenizer
from realloc.estimator.cost import CostModel
from realloc.estimator.profile_table import ProfileTable
from realloc.graph.dataflow import build_graph
from realloc.lengths import ResponseLengths
from realloc.models.hf_io import load_hf_checkpoint
from realloc.strategy import ParallelStrategy

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments/arith_grpo_eos.py"
DATA = REPO / "experiments/data"
CALLS = ("actor_gen", "ref_inf", "actor_train")
REPEATS = 3
# `realloc profile --model experiments/data/arith_sft --device cpu --tp 1 --clock cpu --repeats 9 --out <this>`:
# the SFT checkpoint's own shape (no shipped table matches its 32-token vocabulary), timed in CPU time
PROFILE = REPO / "benchmarks/results/profiles/cpu/arith_sft.json"


def _prompts(tok: Tokenizer, records: list[dict], it: int, n_prompts: int, group: int) -> tuple[dict, list[str]]:
    part = records[it * n_prompts:(it + 1) * n_prompts]
    ids = [tok.encode(r["prompt"]) for r in part for _ in range(group)]
    width = max(len(x) for x in ids)
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    for b, x in enumerate(ids):
        tokens[b, :len(x)] = torch.tensor(x)
    return ({"tokens": tokens, "lengths": torch.tensor([len(x) for x in ids])},
            [r["answer"] for r in part for _ in range(group)])


def _scores(tok: Tokenizer, seq: dict, answers: list[str]) -> torch.Tensor:
    out = []
    for b, ans in enumerate(answers):
        p, g = int(seq["prompt_lens"][b]), int(seq["gen_mask"][b].sum())
        text = tok.decode([t for t in seq["tokens"][b, p:p + g].tolist() if t not in tok.eos_token_ids])
        out.append(1.0 if text.strip() == ans else 0.0)
    return torch.tensor(out)


def best_of(fn: Callable[[], Any], k: int = 0) -> tuple[Any, float]:
    """(fn's result, the least CPU seconds of ``k`` runs (default REPEATS))."""
    best, out = float("inf"), None
    for _ in range(k or REPEATS):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return out, best


def run(iterations: int) -> list[dict]:
    """The run's iterations: each call's CPU seconds and the iteration's response lengths."""
    from realloc.models.engine import ParallelModel

    spec = load_experiment(str(EXPERIMENT))
    cfg_grpo = spec.config.grpo
    tok = Tokenizer.load(DATA / "arith_tokenizer")
    records = [json.loads(line) for line in (DATA / "arith_train.jsonl").read_text().splitlines()]
    group = spec.call("actor_gen").n_samples
    n_prompts = spec.batch_size
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        device = engine_workers.start(0, 1, os.path.join(tmp, "store"), "cpu")
        mcfg = build_graph(spec).model_configs["actor"]  # the run's own config of the checkpoint
        cache, (layout,) = engine_workers.model_layouts(mcfg, [(1, 1, 1)], 1)
        models = {}
        for name in ("actor", "ref", "scratch"):
            models[name] = ParallelModel(mcfg, cache.model_groups(layout), device=device, init="empty")
            load_hf_checkpoint(models[name], str(DATA / "arith_sft"))
        opts = {m: models[m].make_optimizer(cfg_grpo.lr, eps=cfg_grpo.adam_eps) for m in ("actor", "scratch")}
        n = n_prompts * group

        def ctx(call: str, it: int, model: str, n: int = n) -> CallContext:
            train = call == "actor_train"
            return CallContext(call=spec.call(call), model=models[model], optimizer=opts.get(model) if train else None,
                               config=cfg_grpo, prompt_len=spec.prompt_len, gen_len=spec.gen_len, seed=spec.config.seed,
                               iteration=it, ids=range(n), batch_size=n, n_mbs=1, total_iterations=iterations,
                               eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                               vocab_limit=tok.vocab_size, group_size=group,
                               lr_field="lr" if train else None)

        prompts, _ = _prompts(tok, records, 0, 2, 1)
        actor_generate(ctx("actor_gen", 0, "actor", n=2), {"prompts": prompts})  # warm-up
        for it in range(iterations):
            prompts, answers = _prompts(tok, records, it, n_prompts, group)
            secs: dict[str, float] = {}
            # Each call the best of REPEATS CPU times: on a busy machine even CPU time grows with the contention
            # for caches and memory; the least-disturbed repeat is the one closest to a quiet machine. The train
            # step repeats on a scratch copy of the actor (the same parameters, the same kind of optimizer).
            gen, secs["actor_gen"] = best_of(lambda: actor_generate(ctx("actor_gen", it, "actor"),
                                                                    {"prompts": prompts}))
            ref, secs["ref_inf"] = best_of(lambda: actor_logprobs(ctx("ref_inf", it, "ref"),
                                                                  {"seq": gen.outputs["seq"]}))
            gen, ref = gen.outputs, ref.outputs
            inputs = {"seq": gen["seq"], "logp": gen["logp"], "ref_logp": ref["logp"],
                      "rewards": {"score": _scores(tok, gen["seq"], answers)}}
            times = []
            for _ in range(REPEATS - 1):
                # tp 1: params() are the whole tensors
                models["scratch"].load_full_state({k: p.detach() for k, p in models["actor"].params().items()})
                times.append(best_of(lambda: grpo_train(ctx("actor_train", it, "scratch"), inputs), 1)[1])
            times.append(best_of(lambda: grpo_train(ctx("actor_train", it, "actor"), inputs), 1)[1])
            secs["actor_train"] = min(times)
            lengths = gen["seq"]["gen_mask"].sum(dim=1).tolist()
            out.append({"secs": secs, "lengths": lengths, "reward": float(inputs["rewards"]["score"].mean())})
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def estimates(lengths: ResponseLengths | None, profile: ProfileTable | None) -> dict[str, float]:
    spec = load_experiment(str(EXPERIMENT))
    if lengths is not None:
        spec = dataclasses.replace(spec, response_lengths=lengths)
    cost = CostModel(build_graph(spec), profile)
    mesh = spec.cluster.mesh("localhost:0")
    return {c: cost.call_cost(c, mesh, ParallelStrategy(1, 1, 1), 1).time for c in CALLS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=6)
    args = ap.parse_args()
    its = run(args.iterations)
    table = ProfileTable.from_json(PROFILE.read_text(), str(PROFILE))
    fixed = estimates(None, table)
    print(f"{EXPERIMENT.name}: 32 prompts x 8 answers, gen_len 16, lengths from EOS; one device, one CPU thread; "
          f"seconds of this process's CPU time; estimate from the previous iteration's lengths")
    print(f"{'iter':>4} {'lengths (prev)':<22}{'call':<13}{'measured':>9}{'estimate':>9}{'est/meas':>9}"
          f"{'fixed est':>10}{'fixed/meas':>11}{'uncalib.':>9}{'unc/meas':>9}")
    worst, ratios = 0.0, {c: [] for c in CALLS}
    for i in range(1, len(its)):
        prev = ResponseLengths.empirical(its[i - 1]["lengths"])
        est, unc = estimates(prev, table), estimates(prev, None)
        lens = its[i - 1]["lengths"]
        desc = f"mean {sum(lens) / len(lens):.2f}, max {max(lens)}"
        for c in CALLS:
            m = its[i]["secs"][c]
            worst = max(worst, abs(est[c] / m - 1.0))
            ratios[c].append(est[c] / m)
            print(f"{i + 1:>4} {desc:<22}{c:<13}{m:>9.4f}{est[c]:>9.4f}{est[c] / m:>9.2f}{fixed[c]:>10.4f}"
                  f"{fixed[c] / m:>11.2f}{unc[c]:>9.4f}{unc[c] / m:>9.2f}")
            desc = ""
    medians = ", ".join(f"{c} {statistics.median(r):.2f}" for c, r in ratios.items())
    print(f"median est/meas per call: {medians}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rewards = ", ".join(f"{x['reward']:.2f}" for x in its)
    print(f"largest miss of an estimate from the previous iteration's lengths: {100 * worst:.0f}% (rewards {rewards})")


if __name__ == "__main__":
    main()
