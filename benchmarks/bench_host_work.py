"""Where a tiny call's time goes beside its layer ops, in one process (issue 31; docs/estimator.md, "Host work a
table measures").

``bench_call_estimates.py`` compares each call of a kept run with its estimate. This looks inside the calls of
``bench_fusion.py --setting fit``'s actor (model ``tiny``, 32 rows, prompts of 8 tokens, lengths lognormal median 8
and p99 128 from the seeded EOS schedule) in a single process at tp 1, the way a worker runs them, round after
round in turn (a shared machine's load drifts; each call's CPU time is this thread's, which other processes
inflate less than wall time):

- the generation (``common.actor_generate``), the reference's inference (``common.actor_logprobs``) and PPO's actor
  train step (``ppo_interfaces.actor_train``, 2 mini-batches), each with the minor page faults and the kernel
  time it took, beside the estimator's price (``CostModel.call_cost`` at dp 1, the profiles in use);
- the inference's engine forward against the profiler's own op runners (embedding, every block, head) run at the
  same packed shape in the same round: their ratio is the engine's host work around the layers, unaffected by
  how loaded the machine is;
- a generation's KV caches (``new_kv_caches`` of 32 rows x 136 positions) allocated again in a loop, and on pages
  handed back to the operating system first (what ``engine.kv_alloc`` times, ``profiler.release_free_memory``).

    .venv/bin/python benchmarks/bench_host_work.py [--rounds 8] [--profiles DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
ROWS, PROMPT, GEN_LEN, MEDIAN = 32, 8, 128, 8


def measure(fn: Callable[[], object]) -> tuple[float, int, float, object]:
    """(thread CPU seconds, minor page faults, kernel seconds, result) of one call of ``fn``."""
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    c = time.thread_time()
    out = fn()
    cpu = time.thread_time() - c
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    return cpu, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime, out


def estimates(exp: Path) -> dict[str, object]:
    from realloc.api import load_experiment
    from realloc.cluster import DeviceMesh
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.strategy import ParallelStrategy

    cost = CostModel(build_graph(load_experiment(str(exp))))
    mesh = DeviceMesh(("localhost",), 0, 0, 1, 2)
    return {c: cost.call_cost(c, mesh, ParallelStrategy(1, 1, 1), 1) for c in ("actor_gen", "ref_inf", "actor_train")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--profiles", default=None, help="profiles folder ($REALLOC_PROFILES) for the estimates")
    args = p.parse_args()
    if args.profiles:
        os.environ["REALLOC_PROFILES"] = str(Path(args.profiles).resolve())
    import torch
    import torch.distributed as dist

    from bench_fusion import write_experiment
    from realloc.algorithms import common
    from realloc.algorithms.context import CallContext
    from realloc.algorithms.ppo import ppo_interfaces
    from realloc.algorithms.ppo.ppo_config import PPOConfig
    from realloc.calls import InterfaceType, ModelFunctionCallDef
    from realloc.estimator.opcount import Part, Phase
    from realloc.estimator.profiler import LayerProfiler, release_free_memory
    from realloc.lengths import ResponseLengths
    from realloc.models.batch import token_layout, trim
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.strategy import ParallelStrategy

    torch.set_num_threads(1)  # one device is one single-threaded process, as in the runtime
    scratch = Path(tempfile.mkdtemp(prefix="host_work_"))
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'pg'}", rank=0, world_size=1)
    exp = scratch / "fit.py"
    write_experiment(exp, "rm", ROWS, GEN_LEN, actor="tiny", critic="mid-critic", median=MEDIAN)  # the fit setting
    est = estimates(exp)
    cfg = get_model_config("tiny")
    layout = ModelLayout.for_model(cfg, (0,), ParallelStrategy(1, 1, 1))
    cache = ProcessGroupCache()
    cache.ensure_layouts([layout])
    groups = cache.model_groups(layout)
    actor = ParallelModel(cfg, groups, init="random", seed=1)
    ref = ParallelModel(cfg, groups, init="random", seed=2)
    opt = actor.make_optimizer(lr=1e-6)
    prof = LayerProfiler(cfg, groups, clock=time.thread_time)
    settings = PPOConfig(n_minibatches=2, lr=1e-3, critic_lr=1e-3, kl_coef=0.01,
                         length_schedule=ResponseLengths.lognormal(median=MEDIAN, p99=GEN_LEN))

    def ctx(call: str, itype: InterfaceType, model, iteration: int, optimizer=None) -> CallContext:
        rpc = ModelFunctionCallDef(name=call, model_name="actor", model_type="tiny", interface_type=itype,
                                   interface_impl="ppo", input_data=["seq"],
                                   n_minibatches=2 if itype is InterfaceType.TRAIN_STEP else 1)
        return CallContext(call=rpc, model=model, optimizer=optimizer, config=settings, prompt_len=PROMPT,
                           gen_len=GEN_LEN, seed=1, iteration=iteration, ids=range(ROWS), batch_size=ROWS, n_mbs=1,
                           eos_token_ids=(cfg.vocab_size - 1,), pad_token_id=0)

    g = torch.Generator().manual_seed(0)
    prompts = {"tokens": torch.randint(0, cfg.vocab_size - 1, (ROWS, PROMPT), generator=g),
               "lengths": torch.full((ROWS,), PROMPT)}
    got: dict[str, list[tuple[float, int, float]]] = {k: [] for k in ("actor_gen", "ref_inf", "actor_train")}
    fwd_vs_ops: list[tuple[float, float]] = []
    for r in range(args.rounds + 1):  # round 0 warms up
        it = 1 + r % 7  # the schedule's lengths differ by iteration, as a run's do
        *gen, out = measure(lambda: common.actor_generate(ctx("actor_gen", InterfaceType.GENERATE, actor, it),
                                                          {"prompts": prompts}))
        seq = out.outputs["seq"]
        *inf, lp = measure(lambda: common.actor_logprobs(ctx("ref_inf", InterfaceType.INFERENCE, ref, it),
                                                         {"seq": seq}))
        inputs = {"seq": seq, "logp": out.outputs["logp"], "ref_logp": lp.outputs["logp"],
                  "values": {"values": torch.randn(ROWS, GEN_LEN, generator=g) * 0.1},
                  "rewards": {"score": torch.randn(ROWS, generator=g)}}
        *train, _ = measure(lambda: ppo_interfaces.actor_train(
            ctx("actor_train", InterfaceType.TRAIN_STEP, actor, it, opt), inputs))
        # the engine's forward against the profiler's op runners at its packed shape, back to back
        batch = common.forward_batch(seq)
        full, _ = trim(token_layout(batch, "forward", cfg.max_position_embeddings))
        plan = ref._pack(full)
        rows, width = plan.layout.shape if plan is not None else full.shape
        runners = [prof.op_runner(part, Phase.FWD, rows, width)[0] for part in (Part.EMBED, Part.HEAD)]
        runners += [prof.op_runner(Part.BLOCK, Phase.FWD, rows, width)[0]] * cfg.n_layers
        fwd = measure(lambda: ref.forward(batch, n_mbs=1, output="logprobs"))[0]
        ops = sum(measure(run)[0] for run in runners)
        if r:
            for k, v in (("actor_gen", gen), ("ref_inf", inf), ("actor_train", train)):
                got[k].append(tuple(v))
            fwd_vs_ops.append((fwd, ops))
    print(f"one process, tp 1, model tiny, {ROWS} rows, prompt {PROMPT}, lengths lognormal median {MEDIAN} p99 "
          f"{GEN_LEN}; medians over {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'call':<12}{'cpu ms':>8}{'faults':>8}{'sys ms':>8}{'est ms':>8}{'est/cpu':>8}   estimate's parts (ms)")
    for k, v in got.items():
        cpu = statistics.median(x[0] for x in v)
        parts = ", ".join(f"{n} {x * 1e3:.1f}" for n, x in est[k].breakdown().items() if x)
        print(f"{k:<12}{cpu * 1e3:8.1f}{statistics.median(x[1] for x in v):8.0f}"
              f"{statistics.median(x[2] for x in v) * 1e3:8.2f}{est[k].time * 1e3:8.1f}{est[k].time / cpu:8.2f}   "
              f"{parts}")
    fwd, ops = (statistics.median(x[i] for x in fwd_vs_ops) for i in (0, 1))
    print(f"ref_inf's engine forward {fwd * 1e3:.2f} ms against the profiler's ops at its packed shape "
          f"{ops * 1e3:.2f} ms, same rounds: {fwd / ops:.2f}x")
    stage = actor.stage
    for fresh in (False, True):
        times, faults = [], []
        for _ in range(12):
            if fresh:
                release_free_memory()
            cpu, flt, _, caches = measure(lambda: stage.new_kv_caches(ROWS, PROMPT + GEN_LEN))
            del caches
            times.append(cpu)
            faults.append(flt)
        print(f"KV caches of {ROWS} rows x {PROMPT + GEN_LEN} positions, {cfg.n_layers} layers, "
              f"{'on fresh pages' if fresh else 'again in a loop'}: {statistics.median(times) * 1e3:.2f} ms, "
              f"{statistics.median(faults):.0f} page faults")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
