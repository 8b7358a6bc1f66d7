"""Parameter reallocation throughput vs raw gloo bandwidth, and vs megatron-core's resharding.

    .venv/bin/python benchmarks/bench_realloc.py                  # 2 processes, ~470 MB fp32 model
    .venv/bin/python benchmarks/bench_realloc.py --layers 2 --hidden 512 --repeats 2   # quick

One run, one table. For every ordered pair of layouts on 2 processes (each a real
``ParallelModel`` built on megatron-core tensor-parallel layers):

- ours: ``transfer_plan.plan_param_realloc`` + ``param_realloc.Reallocator`` into the
  destination model's live parameters; bytes moved, redundancy ratio, wall time (slowest
  rank, median of repeats), GB/s = moved bytes / time, and that throughput as a fraction of
  the raw gloo broadcast and send/recv bandwidth measured in the same run on one buffer of
  the model's size;
- megatron-core 0.16.1 ``megatron.core.resharding`` (``build_centralized_reshard_plan`` +
  ``execute_reshard_plan`` with its ``GlooCopyService``) on the same two model instances:
  bytes it moves between processes, wall time, and our speedup over it.

Every run is checked bit for bit against the full tensors before it is timed.
2 processes because this machine has 2 cores; 4 would be oversubscribed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from realloc.cluster import ClusterSpec  # noqa: E402
from realloc.graph.transfer_plan import Layout, plan_param_realloc  # noqa: E402
from realloc.models.config import ModelConfig  # noqa: E402
from realloc.models.param_layout import param_specs  # noqa: E402
from realloc.strategy import ParallelStrategy as S  # noqa: E402

LAYOUTS_2 = [("n1:0", S(1, 1, 1)), ("n1:1", S(1, 1, 1)), ("n1", S(2, 1, 1)), ("n1", S(1, 2, 1)), ("n1", S(1, 1, 2))]


def _full(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Cheap deterministic full tensors, distinct per parameter and position."""
    out = {}
    for i, spec in enumerate(param_specs(cfg)):
        t = torch.arange(spec.numel, dtype=torch.int64).remainder_(1021).float().add_(i * 1e-3)
        out[spec.name] = t.view(spec.shape)
    return out


def _fill(model, full: dict[str, torch.Tensor]) -> None:
    model.load_full_state(full)


def _check(model, full: dict[str, torch.Tensor]) -> bool:
    g = model.groups
    return all(torch.equal(p.detach(), full[n][model.specs[n].shard_slices(g.tp, g.tp_rank)])
               for n, p in model.params().items())


def _wall(fn) -> float:
    """The slowest rank's wall time of one collective call of ``fn``."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median wall time of each function, the functions taking turns so that load changes on the
    machine hit all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(_wall(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def _gloo_copy_service():
    """megatron's GlooCopyService without its torch.cuda.Stream, which a CPU-only torch cannot create.

    ``GlooCopyService.__init__`` only records rank/world, creates a world gloo group and a CUDA
    stream; ``run()`` skips the stream when it is None. Everything else is megatron's code.
    """
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    svc = GlooCopyService.__new__(GlooCopyService)
    svc.rank, svc.world_size = dist.get_rank(), dist.get_world_size()
    svc.gloo_pg = dist.new_group(backend="gloo")
    svc.send_ops, svc.recv_ops, svc._copy_stream = [], [], None
    return svc


def _megatron_metadata(model) -> None:
    """What megatron's resharding reads: ``pg_collection`` on the module, and the tensor-parallel
    attributes megatron's layers set only when they initialize weights themselves (our engine
    builds them with ``perform_initialization=False`` and fills them from checkpoints)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    g = model.groups
    model.stage.pg_collection = types.SimpleNamespace(tp=g.tp_group, dp=g.dp_group, pp=g.pp_group)
    for name, p in model.params().items():
        spec = model.specs[name]
        set_tensor_model_parallel_attributes(p, spec.tp_dim is not None, spec.tp_dim if spec.tp_dim is not None
                                             else -1, 1)


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, queue) -> None:
    os.environ["TMPDIR"] = args.tmp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.runtime.transfer.param_realloc import Reallocator

    cfg = ModelConfig("bench", args.vocab, args.hidden, args.inter, args.layers, args.heads, args.heads)
    cluster = ClusterSpec.from_nodelist("n1", world)
    layouts = [Layout(cluster.mesh(m), s) for m, s in LAYOUTS_2]
    cache = ProcessGroupCache()
    cache.ensure_layouts([ModelLayout.for_model(cfg, x.mesh, x.strategy) for x in layouts])
    full = _full(cfg)
    models = {}
    for i, lay in enumerate(layouts):
        if rank in lay.coords_by_device:
            m = ParallelModel(cfg, cache.model_groups(ModelLayout.for_model(cfg, lay.mesh, lay.strategy)), init="empty")
            _fill(m, full)
            _megatron_metadata(m)
            models[i] = m
    pairs = [(i, j) for i, j in itertools.product(range(len(layouts)), repeat=2)
             if i != j and args.only in f"{layouts[i]} -> {layouts[j]}"]
    plans = {(i, j): plan_param_realloc(cfg, layouts[i], layouts[j]) for i, j in pairs}
    realloc = Reallocator(cache, rank)
    realloc.prepare(plans.values())
    svc = None if args.no_megatron else _gloo_copy_service()

    # Raw gloo bandwidth, rank 0 -> rank 1, on buffers we never reallocate.
    buf = torch.zeros(cfg.total_params, dtype=torch.float32)

    def raw(op: str, n_elems: int):
        view = buf[:n_elems]
        if op == "bcast":
            return lambda: dist.broadcast(view, 0)
        return lambda: dist.send(view, 1) if rank == 0 else dist.recv(view, 0) if rank == 1 else None

    out_buf = torch.zeros(cfg.total_params, dtype=torch.float32)

    def raw_links(plan) -> callable:
        """The plan's traffic per directed link (src -> dst), each link one raw message, all at once:
        what an ideal executor of the same bytes would do (no packing, no local copies)."""
        links: dict[tuple[int, int], int] = {}
        for t in plan.transfers:
            for d in t.dsts:
                links[t.src, d] = links.get((t.src, d), 0) + t.nbytes // 4

        def run() -> None:
            works = [dist.isend(out_buf[:n], d) for (s_, d), n in links.items() if s_ == rank]
            works += [dist.irecv(buf[:n], s_) for (s_, d), n in links.items() if d == rank]
            for w in works:
                w.wait()
        return run

    whole = _interleaved({"bcast": raw("bcast", buf.numel()), "p2p": raw("p2p", buf.numel())}, args.repeats)
    raw_bcast, raw_p2p = (buf.numel() * 4 / whole[k] for k in ("bcast", "p2p"))

    rows = []
    empty = torch.nn.Module()
    empty.pg_collection = types.SimpleNamespace(tp=None, dp=None, pp=None)
    for i, j in pairs:
        src, dst = models.get(i), models.get(j)
        plan = plans[i, j]

        def ours() -> None:
            realloc.reallocate(plan, src.params() if src else None, dst.params() if dst else None)

        ours()
        ok = torch.tensor([1 if dst is None or _check(dst, full) else 0])
        # Raw transfers of what the busiest device receives, measured between our runs.
        busiest = max(plan.received_bytes.values(), default=0) // 4
        fns = {"ours": ours, "bcast": raw("bcast", busiest), "links": raw_links(plan)}
        row = dict(pair=f"{layouts[i]} -> {layouts[j]}", moved=plan.moved_bytes, minimal=plan.minimal_bytes,
                   ratio=plan.redundancy_ratio, busiest=busiest * 4)
        if svc is not None:
            from megatron.core.resharding import build_centralized_reshard_plan, execute_reshard_plan

            smod = src.stage if src else empty
            dmod = dst.stage if dst else empty
            t0 = time.perf_counter()
            mplan = build_centralized_reshard_plan(smod, dmod)
            t_mplan = time.perf_counter() - t0
            mine = {n: p for n, p in dmod.named_parameters()}
            moved = sum(mine[op.param_name][op.my_slice].numel() * 4 for op in mplan.recv_ops if op.peer_rank != rank)
            if dst:
                for p in dst.params().values():
                    p.data.fill_(float("nan"))

            def meg() -> None:
                execute_reshard_plan(mplan, smod, dmod, service=svc)

            meg()
            ok[0] &= int(dst is None or _check(dst, full))
            fns["mcore"] = meg
            mv = torch.tensor([moved, t_mplan], dtype=torch.float64)
            dist.all_reduce(mv)
            row.update(moved_meg=int(mv[0]), t_mplan=float(mv[1]) / world)
        t = _interleaved(fns, args.repeats)
        row.update(t_ours=t["ours"], t_bcast=t["bcast"], t_links=t["links"], t_meg=t.get("mcore"))
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        row["ok"] = bool(ok[0])
        rows.append(row)
    if rank == 0:
        queue.put(dict(rows=rows, raw_bcast=raw_bcast, raw_p2p=raw_p2p, model_bytes=cfg.total_params * 4,
                       cfg=dataclasses.asdict(cfg)))
    dist.barrier()
    dist.destroy_process_group()


def _fanout_worker(rank: int, world: int, store: str, args: argparse.Namespace, queue) -> None:
    """One source, three destinations: one broadcast on a 4-process group vs three concurrent sends."""
    os.environ["TMPDIR"] = args.tmp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    buf = torch.zeros(args.fanout_mb * 2**20 // 4)

    def sends() -> None:
        if rank == 0:
            works = [dist.isend(buf, d) for d in range(1, world)]
        else:
            works = [dist.irecv(buf, 0)]
        for w in works:
            w.wait()

    t = _interleaved({"bcast": lambda: dist.broadcast(buf, 0, group=group), "p2p": sends}, args.repeats)
    if rank == 0:
        queue.put(t)
    dist.barrier()
    dist.destroy_process_group()


def _run_workers(target, world: int, args: argparse.Namespace):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = os.path.join(args.tmp, f"store_{target.__name__}")
    procs = [ctx.Process(target=target, args=(r, world, store, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    res = None
    while res is None:
        try:
            res = queue.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty: check that the workers still live
            if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("bench_realloc: a worker failed (see its traceback above)") from None
    for p in procs:
        p.join()
    return res


def _report(res: dict, megatron: bool) -> str:
    bc, p2p = res["raw_bcast"] / 1e9, res["raw_p2p"] / 1e9
    c = res["cfg"]
    out = [f"model: {c['n_layers']} layers, hidden {c['hidden_size']}, vocab {c['vocab_size']}: "
           f"{res['model_bytes'] / 1e6:.0f} MB fp32; 2 gloo processes, 1 thread each",
           f"raw gloo, one {res['model_bytes'] / 1e6:.0f} MB buffer: broadcast {bc:.2f} GB/s, send/recv {p2p:.2f} GB/s",
           "%bcast: time of one raw broadcast of what the busiest device receives / our time;",
           "%links: time of the same per-link bytes as one raw send per (src, dst) link, all at once / our time",
           "(both measured in turns with ours; a pair whose devices both send and receive shares 2 cores both ways)",
           ""]
    head = f"{'layout pair':<40}{'moved MB':>9}{'redund.':>8}{'ours s':>8}{'GB/s':>6}{'%bcast':>7}{'%links':>7}"
    if megatron:
        head += f"{'mcore MB':>9}{'mcore red.':>11}{'mcore s':>8}{'speedup':>8}"
    head += f"{'exact':>6}"
    out += [head, "-" * len(head)]
    eff = []
    for r in res["rows"]:
        line = f"{r['pair']:<40}{r['moved'] / 1e6:>9.1f}{r['ratio']:>8.2f}{r['t_ours']:>8.3f}"
        if not r["moved"]:
            line += f"{'-':>6}{'-':>7}{'-':>7}"
        else:
            eff.append((r["t_bcast"] / r["t_ours"], r["t_links"] / r["t_ours"]))
            line += (f"{r['moved'] / r['t_ours'] / 1e9:>6.2f}{100 * r['t_bcast'] / r['t_ours']:>6.0f}%"
                     f"{100 * r['t_links'] / r['t_ours']:>6.0f}%")
        if megatron:
            red = r["moved_meg"] / r["minimal"] if r["minimal"] else (float("inf") if r["moved_meg"] else 1.0)
            line += f"{r['moved_meg'] / 1e6:>9.1f}{red:>11.2f}{r['t_meg']:>8.3f}{r['t_meg'] / r['t_ours']:>7.1f}x"
        line += f"{'yes' if r['ok'] else 'NO':>6}"
        out.append(line)
    for k, what in enumerate(("raw broadcast of the busiest device's bytes", "raw per-link sends")):
        if eff:
            e = [x[k] for x in eff]
            out += [("" if k else "\n") + f"ours vs {what}, pairs that move bytes: median "
                    f"{100 * statistics.median(e):.0f}%, min {100 * min(e):.0f}%, max {100 * max(e):.0f}%"]
    if megatron:
        sp = [r["t_meg"] / r["t_ours"] for r in res["rows"]]
        out.append(f"speedup over megatron-core resharding: median {statistics.median(sp):.1f}x, min {min(sp):.1f}x "
                   f"(its plan build, not timed above: median {statistics.median(r['t_mplan'] for r in res['rows']):.3f} s)")
    else:
        out.append("megatron-core comparison skipped (--no-megatron)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="run only layout pairs whose name contains this text")
    ap.add_argument("--fanout-mb", type=int, default=100,
                    help="also time one broadcast vs three sends to 3 destinations on 4 processes (0: skip)")
    ap.add_argument("--no-megatron", action="store_true", help="skip the megatron-core resharding comparison")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_realloc_") as tmp:
        args.tmp = tmp
        res = _run_workers(_worker, 2, args)
        print(_report(res, not args.no_megatron))
        if args.fanout_mb:
            t = _run_workers(_fanout_worker, 4, args)
            mb = args.fanout_mb * 2**20 / 1e6
            print(f"\nfan-out, 1 source -> 3 destinations, {mb:.0f} MB, 4 processes on this machine's cores: "
                  f"one broadcast {t['bcast']:.3f} s ({3 * mb / 1e3 / t['bcast']:.2f} GB/s delivered), three "
                  f"concurrent sends {t['p2p']:.3f} s ({3 * mb / 1e3 / t['p2p']:.2f} GB/s); "
                  f"broadcast/sends time ratio {t['bcast'] / t['p2p']:.2f}")


if __name__ == "__main__":
    main()
