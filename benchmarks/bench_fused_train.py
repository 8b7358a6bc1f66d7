"""Fused against serial actor and critic training on the local CPU cluster (issue 33; docs/fused-training.md).

    .venv/bin/python benchmarks/bench_fused_train.py [--experiment experiments/ppo_small.py] [--n-mbs 4]
        [--iterations 5] [--warmup 2] [--repeats 2]

One PPO experiment on the 2-device cluster, every model call at dp 1, tp 1, pp 2 on both devices (no
reallocation), the train calls at ``--n-mbs`` micro-batches: once with actor_train and critic_train one after
the other (each its own 1F1B schedule), once fused (plan field 'fused': one schedule, the critic's stages in
reverse order). The two plans run with ``realloc run``, ``--repeats`` times each, interleaved. Measured: the
train calls' worker time per iteration (serial: the two requests' times added; fused: the one request's),
the median over iterations after ``--warmup``, the fastest repeat (this host's other tenants only add time).
Estimated: the estimator's call times added (serial), ``estimator/fused_cost.price_fused_pair`` (fused). It
prints one table with both beside each other, the ratios, and the load average around every run.

Which profile the estimates read: the shipped ``profiles/cpu/`` by default; ``--profiles DIR`` reads DIR first;
``--fresh-profile`` first profiles this machine now (``fresh_profile.py``: ``realloc profile`` on a small grid
around these calls' shapes, about 15 s; into ``--profiles DIR`` when given, else a temporary folder). With
either, the table prints the shipped profile's estimates beside, against the same runs, and the runs themselves
read that folder too (the master orders the fused passes from its estimates).

A second table (``--ab N``, 0 to skip) times the same two models' optimizer steps in the engine alone, on 2 gloo
processes: each model's ``train_step`` one after the other against ``fused_train_step`` with the schedule the run
used, alternated N times so that the host's load hits both alike (the fastest and the median of each), beside
the schedule's own ratio (the two 1F1B pipelines' time over the fused makespan, RLHFuse Table 3's speed-up).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import engine_workers  # noqa: E402
import fresh_profile  # noqa: E402
from estimator_accuracy import Run, probe_machine, run_plan  # noqa: E402

from realloc.api import load_experiment  # noqa: E402
from realloc.estimator.cost import CostModel  # noqa: E402
from realloc.estimator.fused_cost import FusedPairCost, price_fused_pair  # noqa: E402
from realloc.estimator.hardware import shipped_profiles_dir  # noqa: E402
from realloc.graph.dataflow import build_graph  # noqa: E402
from realloc.graph.plan import ExecutionPlan, validate_plan  # noqa: E402

PAIR = ("actor_train", "critic_train")


def plans(graph, node: str, n_mbs: int) -> dict[str, ExecutionPlan]:
    pl = {c: (node, 2, 1, 1, 1) if graph.model_config(c) is None else (node, 1, 1, 2, n_mbs)
          for c in graph.topo_order}
    return {"serial 1F1B": ExecutionPlan.by_hand(graph, pl, source="bench serial"),
            "fused": ExecutionPlan.by_hand(graph, pl, fused=[PAIR], source="bench fused")}


def train_time(run: Run, fused: bool) -> list[float]:
    """The pair's worker seconds per steady iteration."""
    if fused:
        return run.calls["+".join(PAIR)]
    a, b = (run.calls[c] for c in PAIR)
    return [x + y for x, y in zip(a, b)]


def _ab_worker(rank: int, store: str, spec_path: str, n_mbs: int, order: list, n: int, results) -> None:
    """One of 2 processes: actor and critic of the experiment at pp 2 (the critic's stages reversed), one
    PPO mini-batch's rows per step (this experiment's shapes), serial and fused steps alternated ``n`` times."""
    engine_workers.start(rank, 2, store, "cpu")
    from realloc.models.batch import split_batch
    from realloc.models.engine import ParallelModel
    from realloc.models.fused_train import TrainArgs, fused_train_step
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.strategy import ParallelStrategy

    spec = load_experiment(spec_path)
    graph = build_graph(spec)
    cfgs = [graph.model_config(c) for c in PAIR]
    layouts = [ModelLayout.for_model(cfg, ids, ParallelStrategy(1, 1, 2)) for cfg, ids in zip(cfgs, ((0, 1), (1, 0)))]
    cache = ProcessGroupCache()
    cache.ensure_layouts(layouts)
    models = [ParallelModel(cfg, cache.model_groups(lay), seed=1) for cfg, lay in zip(cfgs, layouts)]
    opts = [m.make_optimizer(1e-5) for m in models]
    rows = spec.batch_size // graph.call(PAIR[0]).n_minibatches
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(1, cfgs[0].vocab_size, (rows, spec.seq_len), generator=g)
    mbs = split_batch({"input_ids": seq, "lengths": torch.full((rows,), spec.seq_len)}, n_mbs)

    def loss(out, mb):
        x = out.values if out.is_critic else out.logprobs()
        return (x * out.token_mask).sum() / out.token_mask.sum(), {}

    args = [TrainArgs(mbs, loss, o, max_grad_norm=1.0) for o in opts]

    def serial():
        for m, a in zip(models, args):
            m.train_step(a.micro_batches, a.loss_fn, a.optimizer, max_grad_norm=a.max_grad_norm)

    steps = {"serial 1F1B": serial, "fused": lambda: fused_train_step(models, args, order)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu = {k: 0.0 for k in steps}  # this process's CPU seconds (its work, whatever the host's load)
    for r in range(n + 1):
        for name, fn in steps.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            c1 = time.process_time()
            dist.barrier()
            if r > 0:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
                cpu[name] += (c1 - c0) / n
    both = torch.tensor([cpu[k] for k in steps], dtype=torch.float64)
    dist.all_reduce(both)  # both processes' work per step
    if rank == 0:
        results.update(times)
        results.update({f"cpu {k}": float(v) for k, v in zip(steps, both)})
    dist.destroy_process_group()


def engine_ab(experiment: str, n_mbs: int, order: list, n: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="bench_fused_ab_") as tmp:
        results = mp.Manager().dict()
        mp.spawn(_ab_worker, args=(os.path.join(tmp, "store"), experiment, n_mbs, order, n, results), nprocs=2)
        return dict(results)


def estimates(cost: CostModel, graph, ps: dict[str, ExecutionPlan], n_mbs: int) -> tuple[dict[str, float],
                                                                                         FusedPairCost]:
    """The pair's estimated seconds per iteration under each plan: the two calls' times added (serial), the fused
    pair's price (fused); and that price."""
    serial = ps["serial 1F1B"]
    meshes = validate_plan(serial, graph)
    priced = price_fused_pair(cost, ps["fused"], *PAIR)
    return {"serial 1F1B": sum(cost.call_cost(c, meshes[c], serial.placements[c].strategy, n_mbs).time for c in PAIR),
            "fused": priced.time}, priced


def run_table(args: argparse.Namespace, spec, graph, ps: dict[str, ExecutionPlan], est: dict[str, float],
              priced: FusedPairCost, shipped: dict[str, float] | None) -> None:
    """The plans run with ``realloc run``, interleaved; the table of estimated beside measured."""
    one, two = probe_machine()
    runs: dict[str, list[Run]] = {name: [] for name in ps}
    with tempfile.TemporaryDirectory(prefix="bench_fused_") as tmp:
        for k in range(args.repeats):
            for name, plan in ps.items():
                run = run_plan(str(REPO / args.experiment), graph, name, plan, args.iterations, args.warmup,
                               Path(tmp), f"r{k}")
                runs[name].append(run)
                print(f"  {name} run {k + 1}: pair {statistics.median(train_time(run, name == 'fused')):.3f} s/it, "
                      f"load {run.load[0]:.1f} -> {run.load[1]:.1f}", flush=True)
    meas = {name: min(statistics.median(train_time(r, name == "fused")) for r in rs) for name, rs in runs.items()}
    mid = {name: statistics.median(statistics.median(train_time(r, name == "fused")) for r in rs)
           for name, rs in runs.items()}
    print(f"\n{spec.name}: batch {spec.batch_size}, {spec.prompt_len}+{spec.gen_len} tokens, {PAIR[0]} + {PAIR[1]} "
          f"at dp1 tp1 pp2, {args.n_mbs} micro-batches, {priced.n_steps} optimizer steps each; iterations "
          f"{args.warmup + 1}..{args.iterations}, fastest of {args.repeats} runs (median run in brackets)")
    print(f"machine: load average {os.getloadavg()[0]:.1f} at the end; probe {one:.2f} s alone, {two:.2f} s with "
          f"two processes ({two / one:.2f}x)\n")
    header = f"{'schedule':<13}{'est. s':>9}{'meas. s':>18}{'est/meas':>10}{'load':>12}"
    if shipped:
        header += f"{'shipped est. s':>16}{'est/meas':>10}"
    print(header)
    print("-" * len(header))
    for name in ps:
        loads = [r.load for r in runs[name]]
        line = (f"{name:<13}{est[name]:>9.3f}{meas[name]:>9.3f} ({mid[name]:.3f}){est[name] / meas[name]:>10.2f}"
                f"{min(x for x, _ in loads):>6.1f}-{max(y for _, y in loads):.1f}")
        if shipped:
            line += f"{shipped[name]:>16.3f}{shipped[name] / meas[name]:>10.2f}"
        print(line)
    s, f = "serial 1F1B", "fused"
    print(f"\nfused speed-up: measured {meas[s] / meas[f]:.2f}x (median runs {mid[s] / mid[f]:.2f}x), estimated "
          f"{est[s] / est[f]:.2f}x; schedule: makespan {priced.schedule.makespan:.3f} s per step against "
          f"{sum(priced.schedule.alone):.3f} s for the two 1F1B pipelines, lower bound "
          f"{priced.schedule.lower_bound:.3f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="experiments/ppo_small.py")
    p.add_argument("--n-mbs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="runs of each plan (0: skip that table)")
    p.add_argument("--ab", type=int, default=8, help="serial/fused engine steps alternated (0: skip that table)")
    p.add_argument("--profiles", default=None, metavar="DIR", help="estimate with the profiles in DIR (read before the "
                   "shipped ones, as realloc --profiles DIR); with --fresh-profile, where the fresh tables go")
    p.add_argument("--fresh-profile", action="store_true",
                   help="profile this machine first (benchmarks/fresh_profile.py, about 15 s) and estimate with that")
    args = p.parse_args()
    spec = load_experiment(str(REPO / args.experiment))
    graph = build_graph(spec)
    ps = plans(graph, spec.cluster.nodes[0], args.n_mbs)
    with tempfile.TemporaryDirectory(prefix="bench_fused_profiles_") as tmp:
        folder = Path(args.profiles or tmp)
        if args.fresh_profile:
            rows = spec.batch_size // graph.call(PAIR[0]).n_minibatches // args.n_mbs
            fresh_profile.profile_models(fresh_profile.model_types(graph), folder, rows=max(rows, 1), seq=spec.seq_len)
        elif args.profiles and not folder.is_dir():
            raise SystemExit(f"--profiles {args.profiles}: no such folder")
        shipped, note = None, ""
        if args.fresh_profile or args.profiles:
            fresh_profile.use(folder)  # this process's estimates and the runs' (the master orders the passes)
            shipped_cost = CostModel(graph, profiles_root=shipped_profiles_dir())
            shipped = estimates(shipped_cost, graph, ps, args.n_mbs)[0]
            note = f"; shipped beside: {fresh_profile.profile_note(shipped_cost)}"
        cost = CostModel(graph)
        print(f"estimates from: {fresh_profile.profile_note(cost)}{note}", flush=True)
        est, priced = estimates(cost, graph, ps, args.n_mbs)
        if args.repeats:
            run_table(args, spec, graph, ps, est, priced, shipped)
    s, f = "serial 1F1B", "fused"
    meshes = validate_plan(ps["serial 1F1B"], graph)
    if args.ab:
        load0 = os.getloadavg()[0]
        ab = engine_ab(str(REPO / args.experiment), args.n_mbs, [[list(x) for x in st] for st in priced.schedule.order],
                       args.ab)
        cpu = {k: ab.pop(f"cpu {k}") for k in (s, f)}
        fused_plan = ps["fused"]
        passes = [cost.train_passes(c, meshes[c], fused_plan.placements[c].strategy, args.n_mbs) for c in PAIR]
        est_cpu = args.n_mbs * sum(sum(fw) + sum(bw) for fw, bw, _ in passes)  # the passes' work, both devices
        fast = {k: min(v) for k, v in ab.items()}
        mids = {k: statistics.median(v) for k, v in ab.items()}
        print(f"\nengine alone: one optimizer step of each model ({spec.batch_size // graph.call(PAIR[0]).n_minibatches}"
              f" rows of {spec.seq_len} tokens, {args.n_mbs} micro-batches), {args.ab} alternations, load "
              f"{load0:.1f} -> {os.getloadavg()[0]:.1f}")
        header = f"{'schedule':<13}{'fastest s':>11}{'median s':>10}{'CPU s, both processes':>23}"
        print(header)
        print("-" * len(header))
        for k in ab:
            print(f"{k:<13}{fast[k]:>11.3f}{mids[k]:>10.3f}{cpu[k]:>23.3f}")
        pairs = statistics.median(x / y for x, y in zip(ab[s], ab[f]))  # neighbours in time see the same load
        print(f"estimated CPU s of both models' passes (no optimizer step): {est_cpu:.3f}")
        print(f"fused speed-up: {fast[s] / fast[f]:.2f}x fastest, {mids[s] / mids[f]:.2f}x median, {pairs:.2f}x median "
              f"of the alternations' own ratios; the schedule's "
              f"{sum(priced.schedule.alone) / priced.schedule.makespan:.2f}x (pipelines only, estimator's pass times)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
