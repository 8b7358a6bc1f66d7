"""``realloc profile``: measure a model's layers and this machine's collectives, write a profile table.

    realloc profile --model tiny --device cpu --tp 1,2 [--out profiles/cpu/tiny.json]

Launches ``max(tp, 2)`` worker processes (gloo on CPU, NCCL on CUDA; one device
and, on CPU, one thread each), times every op of ``profiler.op_plan`` for every
requested tp on ranks 0..tp-1, then times collectives among 2, 4, ... of the
processes (``profile_collectives.py``), and writes the versioned JSON table of
``profile_table.py`` (default ``profiles/<device kind>/<model>.json``).
Results travel from the workers to this process as JSON text over a local queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import shlex
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from realloc.estimator.hardware import PROFILES_ENV, load_hardware_spec, profiles_dir, shipped_profiles_dir
from realloc.estimator.opcount import Part, Phase
from realloc.estimator.profile_collectives import OPS as COLLECTIVE_OPS
from realloc.estimator.profile_collectives import message_sizes
from realloc.estimator.profile_table import CollectiveEntry, ModelArch, OpGrid, ProfileTable, TpTable
from realloc.estimator.profiler import (ENGINE_KEYS, GEN_TOKENS, INTERFACE_GEN_LENS, INTERFACE_KEYS,
                                       OPTIMIZER_LAYERS, PPO_PROMPT_LEN, PROFILED_OPS, LayerGrid, engine_plan,
                                       op_axes, op_plan)
from realloc.models.config import RULE_MODEL_TYPE, ModelConfig, get_model_config, tp_error

DEFAULT_BATCH = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_MAX_COLLECTIVE_BYTES = 64 * 2**20
WORKER_TIMEOUT = 1800.0


@dataclasses.dataclass(frozen=True)
class ProfileJob:
    model_type: str
    device: str  # "cpu" | "cuda"
    kind: str  # device kind (profiles/hardware/<kind>.json)
    dtype: str
    tps: tuple[int, ...]
    grid: LayerGrid
    collective_sizes: tuple[int, ...]  # group sizes
    max_collective_bytes: int
    collective_repeats: int
    # layer ops timed in wall time (median of the repeats), "wall-min" (the fastest repeat: robust to other
    # processes' load), or "cpu": the process's CPU time (profiler.timed)
    clock: str = "wall"
    # every device times the same layer ops at once (each tp group of the world its own copy), rank 0's kept: a
    # device's cost while the others are busy, as in a run (docs/estimator.md, "Waits at dp > 1")
    co_run: bool = False

    @property
    def world(self) -> int:
        return max([*self.tps, *self.collective_sizes, 1])

    def n_steps(self) -> int:
        max_pos = profiled_config(self.model_type).max_position_embeddings
        layer = (sum(1 for _ in op_plan(self.grid)) + len(OPTIMIZER_LAYERS)
                 + sum(1 for _ in engine_plan(self.grid, max_pos)))
        coll = len(COLLECTIVE_OPS) * len(message_sizes(self.max_collective_bytes)) + 1  # + the late all-reduce
        return layer * len(self.tps) + coll * len(self.collective_sizes)


def _parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated positive integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--{what} must be comma-separated positive integers, got {text!r}")
    return tuple(sorted(set(vals)))


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return tuple(out)


def default_grid(cfg: ModelConfig, warmup: int, repeats: int) -> LayerGrid:
    """Powers of two: batch 1..64, sequences 8..min(256, max positions), caches 8..min(512, max positions)."""
    seq = _powers_of_two(8, min(256, cfg.max_position_embeddings))
    ctx = _powers_of_two(8, min(512, cfg.max_position_embeddings))
    return LayerGrid(batch=DEFAULT_BATCH, seq=seq, ctx=ctx, warmup=warmup, repeats=repeats)


def build_job(args: argparse.Namespace) -> ProfileJob:
    if args.model == RULE_MODEL_TYPE:
        raise ValueError(f"--model {RULE_MODEL_TYPE!r} is a parameter-free function; there is nothing to profile")
    cfg = profiled_config(args.model)
    tps = _parse_ints(args.tp, "tp")
    for tp in tps:
        err = tp_error(cfg, tp)
        if err:
            raise ValueError(f"--tp {tp}: {err}")
    kind = getattr(args, "kind", None) or ("cpu" if args.device == "cpu" else None)
    if kind is None:
        raise ValueError("--device cuda needs --kind naming the GPU's hardware spec, e.g. --kind a100-80g")
    hw = load_hardware_spec(kind)
    dtype = getattr(args, "dtype", None) or hw.dtype  # a pool may compute in another of its kind's dtypes
    if dtype not in hw.compute_dtypes:
        raise ValueError(f"--dtype {dtype}: device kind {kind!r} computes in {', '.join(hw.compute_dtypes)}; give "
                         f"one of those (a pool's dtype, docs/heterogeneous.md)")
    warmup, repeats = getattr(args, "warmup", None) or 2, getattr(args, "repeats", None) or 7
    grid = default_grid(cfg, warmup, repeats)
    if getattr(args, "batch_sizes", None):
        grid = dataclasses.replace(grid, batch=_parse_ints(args.batch_sizes, "batch-sizes"))
    if getattr(args, "seq_lens", None):
        grid = dataclasses.replace(grid, seq=_parse_ints(args.seq_lens, "seq-lens"))
    if getattr(args, "ctx_lens", None):
        grid = dataclasses.replace(grid, ctx=_parse_ints(args.ctx_lens, "ctx-lens"))
    longest = max(grid.seq[-1], grid.ctx[-1])
    if longest > cfg.max_position_embeddings:
        raise ValueError(f"sequence/cache length {longest} exceeds the {cfg.max_position_embeddings} positions of "
                         f"{cfg.name}; lower --seq-lens/--ctx-lens")
    n_coll = getattr(args, "collectives", None)
    # one process per device: on CPU two at least (collectives need a pair), on GPUs as many as there are
    world = max(max(tps), 2) if args.device == "cpu" else max(tps)
    sizes = _powers_of_two(2, world) if n_coll is None else tuple(s for s in _parse_ints(n_coll, "collectives")
                                                                  if s >= 2)
    if args.device == "cuda":
        import torch

        n_gpus = torch.cuda.device_count()
        need = max([world, *sizes])
        if need > n_gpus:
            raise ValueError(f"--tp/--collectives need {need} GPUs (one process per GPU) but this machine has "
                             f"{n_gpus}; lower --tp or --collectives")
    return ProfileJob(model_type=args.model, device=args.device, kind=kind, dtype=dtype, tps=tps, grid=grid,
                      collective_sizes=sizes, max_collective_bytes=getattr(args, "max_bytes", None)
                      or DEFAULT_MAX_COLLECTIVE_BYTES, collective_repeats=max(repeats - 2, 3),
                      clock=_clock(args, tps), co_run=bool(getattr(args, "co_run", False)))


def profiled_config(model: str) -> ModelConfig:
    """The config of a registered model type, or of an HF checkpoint directory (its config.json): a model
    with its own shape (vocabulary, layers) gets a table of its own (``ProfileTable.matches``)."""
    if (Path(model) / "config.json").is_file():
        from realloc.models.hf_config import model_config_from_hf

        return model_config_from_hf(model)
    return get_model_config(model)


def _clock(args: argparse.Namespace, tps: tuple[int, ...]) -> str:
    clock = getattr(args, "clock", None) or "wall"
    if clock not in ("wall", "wall-min", "cpu"):
        raise ValueError(f"--clock must be wall, wall-min or cpu, got {clock!r}")
    if clock == "cpu" and (tps != (1,) or args.device != "cpu"):
        raise ValueError("--clock cpu times ops in the process's CPU time, which misses the wait for a peer's "
                         "collective or a GPU's kernels; use it with --device cpu --tp 1")
    return clock


# -- worker ---------------------------------------------------------------------------------------

def profiled_blocks(job: ProfileJob) -> dict[int, list[tuple[int, ...]]]:
    """Per tp, the groups of ranks that time the layer ops: ranks 0..tp-1, or with ``co_run`` every whole group of tp
    ranks of the world, at once (rank 0's times are kept)."""
    return {tp: [tuple(range(k, k + tp)) for k in range(0, (job.world // tp) * tp if job.co_run else tp, tp)]
            for tp in job.tps}


def _die_with(parent: int) -> None:
    """SIGKILL when the `realloc profile` process dies, however it dies (SIGTERM, SIGKILL, a timeout): a worker
    left behind would go on measuring, holding its devices, for the rest of the profile (Linux only)."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the signal was set
        os._exit(1)


def _worker(rank: int, job: ProfileJob, init_file: str, out: "mp.Queue[str]", parent: int) -> None:
    _die_with(parent)
    try:
        _run_worker(rank, job, init_file, out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which exits with one line
        out.put(json.dumps({"type": "error", "rank": rank, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()}))
        raise SystemExit(1)


def _run_worker(rank: int, job: ProfileJob, init_file: str, out: "mp.Queue[str]") -> None:
    import torch
    import torch.distributed as dist

    from realloc.estimator.profile_collectives import LATE_BYTES, LATE_OP, time_collective, time_late_all_reduce
    from realloc.estimator.profiler import LayerProfiler
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.strategy import ParallelStrategy

    # megatron warns about missing Apex/Transformer Engine and CUDA settings, torch about a renamed
    # all-gather; none of it concerns a measurement, and the progress bar is unreadable under it
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    if job.device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if job.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=job.world)
    device = torch.device(f"cuda:{rank}" if job.device == "cuda" else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job.dtype]
    cfg = profiled_config(job.model_type)

    def tick() -> None:
        if rank == 0:
            out.put('{"type": "tick"}')

    cache = ProcessGroupCache()
    # The profiler's models are untied one-layer copies of cfg (LayerProfiler).
    blocks = profiled_blocks(job)
    layouts = {(tp, ranks): ModelLayout(ranks, ParallelStrategy(1, tp, 1), kv_replicas=cfg.kv_replicas(tp))
               for tp in job.tps for ranks in blocks[tp]}
    cache.ensure_layouts(layouts.values())
    cache.ensure_rank_sets([tuple(range(n)) for n in job.collective_sizes])
    result: dict[str, Any] = {"type": "result", "tp": {}, "collectives": []}
    g = job.grid
    for tp in job.tps:
        mine = next((ranks for ranks in blocks[tp] if rank in ranks), None)
        if mine is not None:
            prof = LayerProfiler(cfg, cache.model_groups(layouts[tp, mine]), dtype=dtype, device=device,
                                 clock=time.process_time if job.clock == "cpu" else time.perf_counter,
                                 statistic=min if job.clock == "wall-min" else statistics.median)
            ops: dict[str, dict[tuple[int, int], float]] = {}
            for part, phase, b, s in op_plan(g):
                ops.setdefault(f"{part.value}.{phase.value}", {})[b, s] = prof.time_op(part, phase, b, s, g.warmup,
                                                                                      g.repeats)
                tick()
            opt = []
            for n_layers in OPTIMIZER_LAYERS:
                opt.append(prof.time_optimizer(n_layers, g.warmup, g.repeats))
                tick()
            engine = []
            for kind, b, s in engine_plan(g, cfg.max_position_embeddings):
                engine.append([kind, b, s, prof.time_engine(kind, b, s, g.warmup, g.repeats)])
                tick()
            result["tp"][str(tp)] = {"ops": {k: [[b, s, t] for (b, s), t in v.items()] for k, v in ops.items()},
                                     "optimizer": opt, "engine": engine}
            del prof
        dist.barrier()
    for n in job.collective_sizes:
        ranks = tuple(range(n))
        if rank < n:
            group = cache.get(ranks)
            for op in COLLECTIVE_OPS:
                pts = []
                for nbytes in message_sizes(job.max_collective_bytes):
                    pts.append((nbytes, time_collective(op, group, ranks, nbytes, job.collective_repeats)))
                    tick()
                result["collectives"].append({"op": op, "n": n, "points": pts})
            late = time_late_all_reduce(group, ranks, 10 * job.collective_repeats)
            result["collectives"].append({"op": LATE_OP, "n": n, "points": [(LATE_BYTES, late)]})
            tick()
        dist.barrier()
    if rank == 0:
        out.put(json.dumps(result))
    dist.destroy_process_group()


# -- parent ---------------------------------------------------------------------------------------

def run_workers(job: ProfileJob, show_progress: bool = True) -> dict[str, Any]:
    """Launch the workers, follow their progress, return rank 0's raw result."""
    ctx = mp.get_context("spawn")
    out: "mp.Queue[str]" = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="realloc-profile-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        env_tmp = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp  # torch writes scratch folders there
        try:
            procs = [ctx.Process(target=_worker, args=(r, job, init_file, out, os.getpid()),
                                 daemon=True) for r in range(job.world)]
            for p in procs:
                p.start()
        finally:
            if env_tmp is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = env_tmp
        try:
            return _follow(procs, out, job, show_progress)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)


def _follow(procs: list, out: "mp.Queue[str]", job: ProfileJob, show_progress: bool) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + WORKER_TIMEOUT
    with Progress(TextColumn("profiling {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show_progress, transient=False) as bar:
        task = bar.add_task(f"{job.model_type} tp={','.join(map(str, job.tps))}", total=job.n_steps())
        while True:
            try:
                msg = json.loads(out.get(timeout=1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"profiling worker {dead[0]} died (exit code {procs[dead[0]].exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"profiling did not finish within {WORKER_TIMEOUT:.0f} s")
                continue
            if msg["type"] == "tick":
                bar.advance(task)
            elif msg["type"] == "error":
                if os.environ.get("REALLOC_DEBUG"):
                    print(msg["traceback"], file=sys.stderr)
                raise RuntimeError(f"profiling worker {msg['rank']} failed: {msg['error']}")
            elif msg["type"] == "result":
                return msg


def assemble_table(job: ProfileJob, raw: dict[str, Any], meta: dict[str, Any]) -> ProfileTable:
    from realloc.estimator.comm import Link
    from realloc.estimator.profile_collectives import LATE_OP, fit_alpha_beta

    cfg = profiled_config(job.model_type)
    tps: dict[int, TpTable] = {}
    smoothed: dict[str, dict[str, float]] = {}
    for tp_s, sub in raw["tp"].items():
        ops = {}
        for part, phase in PROFILED_OPS:
            key = f"{part.value}.{phase.value}"
            vals = {(b, s): t for b, s, t in sub["ops"][key]}
            axis = op_axes(part, phase, job.grid)
            ops[key] = OpGrid(batch=list(job.grid.batch), seq=list(axis),
                              seconds=[[vals[b, s] for s in axis] for b in job.grid.batch])
            if int(tp_s) > 1:
                ops[key], rms = smooth_grid(ops[key])
                smoothed.setdefault(tp_s, {})[key] = round(rms, 4)
        layer_table = TpTable(ops=ops, optimizer=[(int(n), float(t)) for n, t in sub["optimizer"]])
        ops.update(engine_overheads(cfg, int(tp_s), layer_table, sub["engine"], job))
        tps[int(tp_s)] = TpTable(ops=ops, optimizer=layer_table.optimizer)
    colls = []
    for c in raw["collectives"]:
        pts = [(float(x), float(t)) for x, t in c["points"]]
        alpha, beta = (pts[0][1], 0.0) if c["op"] == LATE_OP else fit_alpha_beta(pts)  # one size: its mean
        colls.append(CollectiveEntry(op=c["op"], n=c["n"], link=Link.INTRA, alpha=alpha, beta=beta, points=pts))
    if smoothed:
        meta = {**meta, "smoothed_tp_ops_rms_relative_residual": smoothed}
    return ProfileTable(device_kind=job.kind, model_type=job.model_type, dtype=job.dtype, arch=ModelArch.of(cfg),
                        tp=tps, collectives=colls, meta=meta)


def smooth_grid(grid: OpGrid) -> tuple[OpGrid, float]:
    """The least-squares fit t = c0 + c1 b + c2 s + c3 b s over the grid (relative error), and the rms
    relative residual of the measurements.

    Used for tp > 1: an op over a tensor-parallel group spends much of its time in collectives whose
    gloo latency drifts between phases of a run (repeating one point minutes apart on the 2-core
    machine here gave 4.5 to 8.6 ms for the same block), so single points are off by up to 30%
    while the surface is smooth: GEMM work in b x s, per-sequence and per-token work, a latency
    floor (a decode step: weights in b, attention in b x cached positions).
    """
    import numpy as np

    b = np.array([x for x in grid.batch for _ in grid.seq], dtype=np.float64)
    s = np.array([y for _ in grid.batch for y in grid.seq], dtype=np.float64)
    t = np.array([v for row in grid.seconds for v in row], dtype=np.float64)
    cols = [np.ones_like(b), b] + ([s, b * s] if len(grid.seq) > 1 else [])
    design = np.stack(cols, axis=1)
    if len(t) <= design.shape[1]:
        return grid, 0.0
    coef, *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    fit = np.maximum(design @ coef, MIN_SECONDS)
    rms = float(np.sqrt(np.mean(((t - fit) / t) ** 2)))
    seconds = fit.reshape(len(grid.batch), len(grid.seq)).tolist()
    return OpGrid(batch=list(grid.batch), seq=list(grid.seq), seconds=seconds), rms


def command_line(args: argparse.Namespace) -> str:
    """The ``realloc profile`` command that reproduces this run."""
    parts = ["realloc", "profile", "--model", args.model, "--device", args.device, "--tp", args.tp]
    for opt in ("kind", "batch_sizes", "seq_lens", "ctx_lens", "collectives", "max_bytes", "warmup", "repeats",
                "clock", "out"):
        v = getattr(args, opt, None)
        if v is not None and not (opt == "clock" and v == "wall"):
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if getattr(args, "co_run", False):
        parts.insert(parts.index("--tp") + 2, "--co-run")
    return " ".join(shlex.quote(p) for p in parts)


MIN_SECONDS = 1e-7  # grid values must be positive; a residual lost in the noise is stored as this


def theil_sen(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Robust line (alpha, beta) through (x, y) points: the median of pairwise slopes, then the median
    intercept; both clamped at 0. One outlier (a preempted run on a shared machine) cannot move it."""
    slopes = sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:]
                    if x2 != x1)
    beta = max(slopes[len(slopes) // 2] if slopes else 0.0, 0.0)
    icepts = sorted(y - beta * x for x, y in points)
    return max(icepts[len(icepts) // 2], 0.0), beta


def split_train_overheads(points: list[tuple[float, float, float]]) -> tuple[tuple[float, float],
                                                                             tuple[float, float]]:
    """(alpha, beta) of the per-micro-batch overhead, a line in the tokens x, and of the per-step one.

    ``points`` are (x, r1, r2): the residuals of train_step() over one and over two micro-batches of x
    tokens. r2 - r1 is one micro-batch's overhead. What remains of r1 is the optimizer step's own
    work (gradient norm, clipping, zeroing: passes over the parameters), which does not depend on
    the tokens: it is a constant (beta 0). Fitting it as a line let the noise of two differences
    tilt it, and the estimator then multiplied the tilt by the stage's parameter count (at tp=2,
    66 ms instead of 2 ms per step at 4096 tokens).
    """
    mb = theil_sen([(x, r2 - r1) for x, r1, r2 in points])
    rest = sorted(r1 - (mb[0] + mb[1] * x) for x, r1, _ in points)
    return mb, (max(rest[len(rest) // 2], 0.0), 0.0)


def engine_overheads(cfg: ModelConfig, tp: int, layers: TpTable, raw: list, job: ProfileJob) -> dict[str, OpGrid]:
    """The engine's overheads: measured engine calls minus the layer ops they ran (``profiler.ENGINE_KEYS``),
    and PPO's train interface minus the engine's train step (``profiler.INTERFACE_KEYS``).

    The layer ops come from the same run, looked up through ``ProfiledCosts`` so that the
    generation's decode steps at cache lengths between grid points are interpolated. Each
    overhead is a difference of two noisy medians, so it is fitted as a robust line in the
    tokens it handles (b x s; b for a decode step) and stored evaluated on the layer grid.
    """
    from realloc.cluster import ClusterSpec
    from realloc.estimator.comm import CommModel
    from realloc.estimator.profile_table import ProfiledCosts
    from realloc.estimator.roofline import RooflineCosts
    from realloc.models.param_layout import shard_numel

    one = cfg.with_layers(1, is_critic=False, tie_embeddings=False)
    cluster = ClusterSpec.from_nodelist("localhost", 2, job.kind)
    comm = CommModel(cluster)
    table = ProfileTable(device_kind=job.kind, model_type=job.model_type, dtype=job.dtype, arch=ModelArch.of(cfg),
                         tp={tp: layers})
    costs = ProfiledCosts(table, one, RooflineCosts(one, cluster.hardware, comm), comm)

    def op(part: Part, phase: Phase, b: int, s: int) -> float:
        return sum(costs.op(part, phase, tp, b, s))

    def parts(phase: Phase, b: int, s: int, layers: int = 1) -> float:
        return op(Part.EMBED, phase, b, s) + layers * op(Part.BLOCK, phase, b, s) + op(Part.HEAD, phase, b, s)

    opt = costs.optimizer(shard_numel(one, tp, 1, 0))
    pts: dict[str, list[tuple[float, float]]] = {k: [] for k in (*ENGINE_KEYS, *INTERFACE_KEYS)}
    train: list[tuple[float, float, float]] = []
    for kind, b, s, t in raw:
        if kind == "ppo_train":  # s: generated tokens per sequence
            pts["interface.train"].append((s, t["interface"] - t["engine"]))
        elif kind == "forward":
            pts["engine.fwd"].append((b * s, t["engine.fwd"] - parts(Phase.FWD, b, s)))
        elif kind in ("row_drop_used", "kv_touch"):  # b rows of caches of s positions, per layer: a line in b x s
            pts[f"engine.{kind}"].append((b * s, t[f"engine.{kind}"]))
        elif kind == "schedule":  # what the schedule adds to a step's draw of b rows: a line in b
            pts["engine.schedule_step"].append((b, t["scheduled"] - t["plain"]))
        elif kind == "train":
            mb = parts(Phase.FWD, b, s) + parts(Phase.BWD, b, s)
            train.append((b * s, t["train1"] - (mb + opt), t["train2"] - (2 * mb + opt)))
        else:
            res = {}
            layers = int(t.get("layers", 1))  # generate() ran on a model of this many layers
            for n in GEN_TOKENS:
                model = parts(Phase.PREFILL, b, s, layers) + sum(parts(Phase.DECODE, b, c, layers)
                                                                  for c in range(s + 1, s + n))
                res[n] = t[f"gen{n}"] - model
            lo, hi = GEN_TOKENS
            step = (res[hi] - res[lo]) / (hi - lo)
            pts["engine.decode_step"].append((b, step))
            pts["engine.gen_call"].append((b * s, res[lo] - lo * step))
    out = {}
    g = job.grid
    fits = {key: theil_sen(p) for key, p in pts.items() if p}
    if train:
        fits["engine.train_mb"], fits["engine.train_step"] = split_train_overheads(train)
    for key, (alpha, beta) in fits.items():
        if key == "interface.train":  # a line in the generated tokens, flat in the batch
            lens = [t for t in INTERFACE_GEN_LENS if PPO_PROMPT_LEN + t <= cfg.max_position_embeddings]
            out[key] = OpGrid(batch=list(g.batch), seq=lens,
                              seconds=[[max(alpha + beta * t, MIN_SECONDS) for t in lens] for _ in g.batch])
        elif key in ("engine.decode_step", "engine.schedule_step"):
            out[key] = OpGrid(batch=list(g.batch), seq=[1],
                              seconds=[[max(alpha + beta * b, MIN_SECONDS)] for b in g.batch])
        elif key in ("engine.row_drop_used", "engine.kv_touch"):  # over cache slots
            out[key] = OpGrid(batch=list(g.batch), seq=list(g.ctx),
                              seconds=[[max(alpha + beta * b * s, MIN_SECONDS) for s in g.ctx] for b in g.batch])
        else:
            out[key] = OpGrid(batch=list(g.batch), seq=list(g.seq),
                              seconds=[[max(alpha + beta * b * s, MIN_SECONDS) for s in g.seq] for b in g.batch])
    return out


def output_path(args: argparse.Namespace, job: ProfileJob) -> Path:
    """``--out``, or ``<--profiles DIR>/<kind>/<model>.json``; never the shipped profiles by default."""
    if args.out:
        return Path(args.out)
    name = Path(job.model_type).name  # a model type, or an HF checkpoint directory's name
    if job.dtype != load_hardware_spec(job.kind).dtype:
        name = f"{name}-{job.dtype}"  # beside the kind's own dtype's table, not over it
    if os.environ.get(PROFILES_ENV):
        return profiles_dir() / job.kind / f"{name}.json"
    shipped = shipped_profiles_dir() / job.kind / f"{name}.json"
    raise ValueError(f"where should the profile go? pass --profiles DIR (writes DIR/{job.kind}/{name}.json, "
                     f"which `realloc search/run --profiles DIR` read before the shipped profiles) or --out FILE; "
                     f"the shipped {shipped} is replaced only when named with --out")


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(args: argparse.Namespace) -> int:
    from realloc.models.collective_wait import spin_seconds

    spin_seconds()  # the workers' train steps wait by it: a bad setting is one line here, not a worker's failure
    job = build_job(args)
    path = output_path(args, job)
    if job.device == "cuda":
        import torch

        if torch.cuda.device_count() < job.world:
            raise ValueError(f"--device cuda needs {job.world} GPUs on this machine for tp {max(job.tps)} and the "
                             f"collectives, found {torch.cuda.device_count()}")
    t0 = time.time()
    load_before = _load_average()
    raw = run_workers(job, show_progress=not getattr(args, "quiet", False))
    import torch

    meta = {
        "command": command_line(args),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        "threads_per_process": 1 if job.device == "cpu" else None,
        "warmup": job.grid.warmup, "repeats": job.grid.repeats, "clock": job.clock, "co_run": job.co_run,
        "statistic": f"{'minimum' if job.clock == 'wall-min' else 'median'} over repeats; each repeat is the slowest "
                     f"rank of the group",
    }
    table = assemble_table(job, raw, meta)
    table.save(path)
    n_points = sum(len(g.batch) * len(g.seq) for sub in table.tp.values() for g in sub.ops.values())
    print(f"wrote {path}: {n_points} layer points for tp {','.join(map(str, job.tps))}, "
          f"{len(table.collectives)} collective fits, in {meta['seconds']} s")
    for c in table.collectives:
        if c.op in ("all_reduce", "broadcast"):
            bw = 1 / c.beta / 1e9 if c.beta > 0 else float("inf")
            print(f"  {c.op:<11} n={c.n}: alpha {c.alpha * 1e6:7.1f} us, {bw:6.2f} GB/s")
        elif c.op == "all_reduce_late":  # docs/estimator.md, "Waits at dp > 1"
            print(f"  {c.op} n={c.n}: {c.alpha * 1e6:7.1f} us from the last arrival (mean)")
    return 0
