"""``realloc run EXP``: plan (or load a plan), launch the model workers and the master, and train.

    realloc run experiments/ppo_tiny.py --baseline heuristic --iterations 30
    realloc run EXP --plan plan.json --save-every 10 --run-dir runs/a
    realloc run EXP --resume runs/a                     # continues from the newest checkpoint
    realloc run EXP --set ppo.lr=1e-6 --set batch_size=64   # experiment fields from the command line
    realloc run EXP --launcher slurm --dry-run          # prints the sbatch script, writes nothing
    realloc run EXP --launcher slurm --partition gpu --time 4:00:00 --setup "module load cuda"

A run directory holds run.json (the experiment, the overrides in force and every session's history),
config/ (the fully resolved experiment, a copy of its files, versions: ``records/run_record.py``), plan.json,
metrics.jsonl (one line per iteration, counted from 1), trace.json (Chrome trace of every device),
logs/worker<r>.log and checkpoints/iter_<N> (the state after iteration N: every --save-every N iterations and
after the last one, the newest --keep-checkpoints of them kept). ``--resume`` reapplies the checkpoint's
overrides and refuses a changed setting unless --allow-changed-settings (``persist/run_settings.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from realloc.api import ExperimentSpec
from realloc.atomic_file import write_text_atomically
from realloc.cli import DEFAULT_SEARCH_TIME
from realloc.estimator.hardware import PROFILES_ENV
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.control.stop_signals import StopSignals
from realloc.runtime.control.store_listener import store_listener
from realloc.runtime.inputs.preflight import Preflight, preflight
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.control.master_link import KILL_GRACE
from realloc.runtime.launch.launcher import (LocalLauncher, SlurmOptions, WorkerConfig, slurm_script, submit_slurm,
                                      write_job_script)
from realloc.runtime.launch.pool_launch import check_pools
from realloc.runtime.persist.run_settings import resume_settings
from realloc.runtime.records.metric_sinks import MetricSinks, check_wandb_installed
from realloc.runtime.records.progress import LONG_CALL_S, RunProgress
from realloc.runtime.records.prepare_undo import PreparedDir, contents
from realloc.runtime.records.run_claim import LOCK_WAIT_S, claim_run_dir, remove_created
from realloc.runtime.records.run_paths import RunPaths, naming, remove_secret
from realloc.runtime.records.run_record import Session, data_record, resolved_experiment, write_run_record
from realloc.runtime.records.startup import StartupClock, settle_heap
from realloc.runtime.wire import protocol

MIN_HEARTBEAT_TIMEOUT = 2.0


def _choose_plan(args: argparse.Namespace, spec: ExperimentSpec, ckpt: Path | None) -> tuple[ExecutionPlan, str]:
    """The plan to run and where it came from, in words, for the run header."""
    if args.plan or ckpt is not None:
        plan = ExecutionPlan.load(args.plan or ckpt / "plan.json")
        if getattr(args, "no_fused_pairs", False) and plan.fused:  # the opt-out must not be ignored in silence
            where = f"file {args.plan}" if args.plan else f"of checkpoint {ckpt}"
            raise ValueError(f"--no-fused-pairs: the plan {where} fuses {' + '.join(plan.fused[0])}; remove its "
                             f"\"fused\" entry (or pass --plan a plan without one)")
        return plan, (f"from {args.plan}{plan.edited_note()}" if args.plan else f"of checkpoint {ckpt}")
    try:
        import realloc.search as search_pkg
    except ImportError as e:  # pragma: no cover - the package always exists
        raise ValueError(f"plan search is unavailable ({e}); pass --plan plan.json") from None
    if args.baseline:
        fn = getattr(search_pkg, "baseline", None)
        if fn is None:
            raise ValueError("--baseline needs realloc.search.baseline, which is not available yet; pass --plan")
        return fn(spec, args.baseline), f"baseline {args.baseline}"
    fn = getattr(search_pkg, "search", None)
    if fn is None:
        raise ValueError("plan search (realloc.search.search) is not available yet; pass --plan plan.json or "
                         "--baseline heuristic")
    runnable = search_pkg.RunLimits(fused_pairs=not getattr(args, "no_fused_pairs", False))  # what this runtime runs
    if args.search_time is not None:
        return fn(spec, args.search_time, runnable=runnable), f"searched for {args.search_time:g} s"
    # No time given: search until the best plan stops improving, at most DEFAULT_SEARCH_TIME (engine.converged).
    t0 = time.perf_counter()
    plan = fn(spec, DEFAULT_SEARCH_TIME, converge=True, runnable=runnable)
    return plan, f"searched for {time.perf_counter() - t0:.1f} s (until it converged, at most {DEFAULT_SEARCH_TIME:g} s)"


def _run_dir(args: argparse.Namespace, spec: ExperimentSpec, ckpt: Path | None) -> tuple[Path, bool]:
    """The run directory, and whether realloc chose its name (a peer's run of that name makes it take a suffix)."""
    if args.run_dir:
        return Path(args.run_dir), False
    if ckpt is not None and ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent, False  # continue the checkpoint's own run
    return Path("runs") / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}", True


def _schedule_horizon(args: argparse.Namespace, total: int, meta: dict[str, Any] | None) -> tuple[int, str | None]:
    """The iterations the learning-rate schedule spans, and a header line when it is not this run's end.

    A fresh run's schedule ends with it. A resumed run keeps its checkpoint's horizon, so it continues the
    schedule it was on (an interrupted run resumes exactly); ``--schedule-iterations`` sets it explicitly.
    """
    if args.schedule_iterations is not None:
        if args.schedule_iterations < 1:
            raise ValueError(f"--schedule-iterations must be a positive integer, got {args.schedule_iterations}")
        horizon, source = args.schedule_iterations, "--schedule-iterations"
    elif meta is not None and meta.get("schedule_iterations") is not None:
        horizon, source = meta["schedule_iterations"], "the checkpoint"
        if type(horizon) is not int or horizon < 1:
            raise ValueError(f"checkpoint meta.json: schedule_iterations must be a positive integer, got {horizon!r}; "
                             f"pass --schedule-iterations N")
    else:
        return total, None
    if horizon == total:
        return horizon, None
    after = (f"; iterations {horizon + 1}..{total} keep its last learning rate (--schedule-iterations N "
             f"stretches it)" if total > horizon else "")
    return horizon, f"learning-rate schedule over iterations 1..{horizon} ({source}){after}"


def _truncate_metrics(path: Path, start: int) -> None:
    """A resumed run rewrites the iterations after its checkpoint: drop the killed run's lines for them
    (``start`` iterations are done; metrics.jsonl counts iterations from 1). A half-written last line
    (the run was killed while writing it) is dropped too."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON; fix or delete that line, then resume") from None
            print(f"realloc run: dropped the half-written last line of {path} (the run was killed while writing it)",
                  file=sys.stderr)
            continue
        if not isinstance(record, dict) or record.get("iteration", 0) <= start:
            keep.append(line)
    # through a new file: rewritten in place, a kill or a full disk midway lost the history the run keeps
    with naming(path):
        write_text_atomically(path, "".join(line + "\n" for line in keep))


def _drop_later_samples(run: RunPaths, start: int) -> None:
    """The logged samples and eval rows of iterations after ``start`` (a killed run's, rewritten by this one):
    their files are appended to, so they would otherwise hold those iterations twice."""
    from realloc.runtime.records.text_io import SAMPLES_FILE  # (torch: imported only for a run)

    samples = run.root / SAMPLES_FILE
    if samples.is_file():
        kept = []
        for line in samples.read_text().splitlines():
            try:
                if json.loads(line).get("iteration", 0) <= start:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                pass  # a half-written line of the killed run
        with naming(samples):
            write_text_atomically(samples, "".join(line + "\n" for line in kept))  # (as _truncate_metrics)
    for f in (run.root / "eval").glob("iter_*.rank*.jsonl"):
        done = f.name.removeprefix("iter_").split(".")[0]
        if done.isdigit() and int(done) > start:
            f.unlink()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM before the master runs stops ``realloc run`` at once, like Ctrl-C."""
    raise KeyboardInterrupt


def _fresh_secret(run: RunPaths) -> bytes:
    secret = protocol.new_secret()
    run.secret.unlink(missing_ok=True)
    protocol.write_secret_file(run.secret, secret)
    return secret


def main(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as claims:
        return _main(args, claims)


def _main(args: argparse.Namespace, claims: contextlib.ExitStack) -> int:
    # torch loads in the master only after the workers started (they load it too, meanwhile): the master's
    # torch imports (Master, checkpoints, preflight's tokenizer) come below the launcher's prestart.
    clock = StartupClock()
    clock.mark("imports")
    from realloc.runtime.control.master_link import RunFailed

    if args.save_every < 0:
        raise ValueError(f"--save-every must be >= 0, got {args.save_every}")
    if args.call_timeout is not None and not args.call_timeout >= MIN_HEARTBEAT_TIMEOUT:
        raise ValueError(f"--call-timeout must be at least {MIN_HEARTBEAT_TIMEOUT:g} s (workers report their request "
                         f"every second), got {args.call_timeout:g}")
    if args.heartbeat_timeout is not None and not args.heartbeat_timeout >= MIN_HEARTBEAT_TIMEOUT:
        raise ValueError(f"--heartbeat-timeout must be at least {MIN_HEARTBEAT_TIMEOUT:g} s (workers beat every "
                         f"second), got {args.heartbeat_timeout:g}")
    if args.search_time is not None and not 0 < args.search_time < float("inf"):  # nan searched forever
        raise ValueError(f"--search-time must be a positive, finite number of seconds, got {args.search_time:g}")
    stop_signals = StopSignals.parse(args.warning_signal)
    if args.run_dir and Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
        raise ValueError(f"--run-dir {args.run_dir} is a file; give a directory (created if missing)")
    if args.launcher != "slurm" and (args.dry_run or args.prepare):
        raise ValueError(f"{'--dry-run' if args.dry_run else '--prepare'} applies to --launcher slurm; for a local "
                         f"run, `realloc search EXP` shows the plan")
    if args.export_every < 0:
        raise ValueError(f"--export-every must be >= 0, got {args.export_every}")
    if args.keep_checkpoints < 0:
        raise ValueError(f"--keep-checkpoints must be >= 0 (0 keeps all), got {args.keep_checkpoints}")
    if args.allow_changed_settings and not args.resume:
        raise ValueError("--allow-changed-settings applies to --resume (a fresh run has no earlier settings)")
    sets = tuple(args.set)
    from realloc.runtime.persist import checkpoint  # (a fresh run sets a used run directory's checkpoints aside)

    if args.resume:
        ckpt = checkpoint.resolve_resume(args.resume, args.skip_checkpoint_checks)
    else:
        ckpt = None
    changed: tuple[str, ...] = ()
    reapplied: tuple[str, ...] = ()
    data = None  # the dataset files' digests a resume already computed (records/data_digest.py)
    if ckpt is None:
        spec = load_with_overrides(args.experiment, sets)
    else:  # the checkpoint's run's overrides again; a changed setting only with --allow-changed-settings
        resumed = resume_settings(args.experiment, ckpt, checkpoint.read_meta(ckpt), sets, args.allow_changed_settings)
        spec, sets, changed, reapplied = resumed.spec, resumed.overrides, resumed.changed, resumed.recorded
        data = resumed.data
    check_pools(spec.cluster)  # pools run under every launcher, all CPU or all GPU (launch/pool_launch.py)
    if spec.cluster.pools and args.launcher == "local":
        _check_local(spec)  # before the search: GPU pools need their GPUs on this machine
    graph = build_graph(spec)
    config = RunConfig.of(spec)
    start = 0
    meta: dict[str, Any] | None = None
    if ckpt is not None:
        meta = checkpoint.read_meta(ckpt)
        if meta.get("graph_digest") != graph.digest:
            raise ValueError(f"--resume {ckpt}: the checkpoint was written by a different version of experiment "
                             f"{spec.name!r} (graph digest {meta.get('graph_digest')} != {graph.digest})")
        start = int(meta["next_iteration"])
        if not args.skip_checkpoint_checks:
            checkpoint.check_files(ckpt)  # missing or truncated files: one error before anything starts
    if args.iterations is not None and args.iterations < 1:
        raise ValueError(f"--iterations must be a positive integer, got {args.iterations}")
    total = args.iterations if args.iterations is not None else config.iterations
    if total is None:
        raise ValueError(f"how many iterations? pass --iterations N or set `iterations` in {spec.name}")
    if total <= start:
        raise ValueError(f"--iterations {total}: the checkpoint already completed {start} iterations; ask for more")
    horizon, horizon_line = _schedule_horizon(args, total, meta)
    # One run per directory (run_claim.py): a second `realloc run` on it is one error naming the first.
    root, default_name = _run_dir(args, spec, ckpt)
    before = contents(root.resolve()) if args.launcher == "slurm" else None  # what a failed prepare keeps
    root, created, lock = claim_run_dir(root.resolve(), not args.dry_run or args.prepare, default_name,
                                        wait_s=LOCK_WAIT_S if args.launcher == "external" else 0.0)
    if lock is not None:
        claims.callback(os.close, lock)  # held until this command returns (the kernel frees it on any exit)
    run = RunPaths(root)
    local: LocalLauncher | None = None
    try:  # a command that fails before it launches anything leaves no directory behind
        if args.launcher == "local":
            # The workers start now and import torch and megatron while the master checks the prompts and
            # searches; they get their arguments once the master listens (launcher.py).
            # Worker 0 serves the workers' rendezvous on a socket bound here, so this process needs no torch.
            local = LocalLauncher(run, spec.cluster.n_devices, store=store_listener(args.bind, args.store_port))
            local.prestart()
        # Fail here, in one line, rather than in every worker; and tokenize once: the workers read the cache.
        pre = preflight(spec, config, graph, cache_dir=None if args.dry_run else run.prompt_cache)
        clock.mark("experiment")
        slurm = slurm_options(args) if args.launcher == "slurm" else None
        plan, plan_source = _choose_plan(args, spec, ckpt)
        clock.mark("search")
        program = RuntimeProgram(graph, plan)  # validates the plan against the experiment and cluster
        if ckpt is not None and meta is not None:  # the workers would refuse the shards; say so before they start
            checkpoint.check_resume_layouts(ckpt, meta.get("layouts", {}), {
                m: (program.calls[program.home_call(m)].strategy.tp, program.calls[program.home_call(m)].strategy.pp)
                for m in program.models if program.is_trained(m)})
        if slurm is not None:
            slurm.check(spec.cluster)
        elif args.launcher == "local":
            _check_local(spec)
        if args.wandb and (slurm is None or not slurm.setup):
            check_wandb_installed()
    except BaseException:
        if local is not None:
            local.stop(grace=KILL_GRACE)
        if created is not None:
            remove_created(run.root, created)
        raise
    run_id = args.run_id or secrets.token_hex(8)
    experiment = spec.source or args.experiment
    resolved = resolved_experiment(spec, graph, config)  # every setting: run dir, checkpoints, TensorBoard, W&B
    session = Session(experiment=experiment, overrides=sets, given=tuple(args.set),
                      resumed_from=str(ckpt) if ckpt is not None else None, first_iteration=start + 1,
                      last_iteration=total, changed=changed, data=data)

    if slurm is not None:
        master_args = ["--plan", str(run.plan), "--iterations", str(total), "--save-every", str(args.save_every),
                       "--export-every", str(args.export_every), "--quiet", *(x for item in sets for x in ("--set", item)),
                       "--keep-checkpoints", str(args.keep_checkpoints)]
        if not args.final_checkpoint:
            master_args.append("--no-final-checkpoint")
        if args.allow_changed_settings:
            master_args.append("--allow-changed-settings")
        if not args.tensorboard:
            master_args.append("--no-tensorboard")
        if args.wandb:
            if not slurm.setup:
                # The job inherits this environment, so check before it waits in the queue; --setup lines may
                # activate another one, where the job's own master checks.
                check_wandb_installed()
            master_args += ["--wandb", args.wandb]
        if ckpt is not None:
            master_args += ["--resume", str(ckpt)]
        if args.heartbeat_timeout is not None:
            master_args += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
        if args.call_timeout is not None:
            master_args += ["--call-timeout", str(args.call_timeout)]
        master_args += ["--warning-signal", str(stop_signals)]
        if args.skip_checkpoint_checks:
            master_args.append("--skip-checkpoint-checks")
        if args.schedule_iterations is not None:
            master_args += ["--schedule-iterations", str(args.schedule_iterations)]
        profiles = os.environ.get(PROFILES_ENV)  # --profiles DIR, or the environment's
        if profiles:
            master_args += ["--profiles", profiles]
        script = slurm_script(spec.cluster, experiment, run, run_id, master_args, slurm, overrides=sets,
                              stop_signals=stop_signals, profiles=profiles)
        if args.dry_run and not args.prepare:
            print(script, end="")  # nothing is written: --prepare writes the run directory
            return 0
        with PreparedDir(run.root, before, created):  # a full disk half way: what it wrote goes, the rest stays
            _prepare_run_dir(run, plan, spec, session, pre, resolved)
            _fresh_secret(run)
            path = write_job_script(script, run)
        if args.prepare or args.dry_run:
            print(f"prepared {run.root}; submit it with: sbatch {path}")
            return 0
        job = submit_slurm(script, run)
        print(f"submitted SLURM job {job}; run directory {run.root}")
        return 0

    # Before anything starts: a missing wandb package is one error with no worker to stop.
    sinks = MetricSinks.open(run.root, tensorboard=args.tensorboard, wandb_project=args.wandb,
                             run_name=run.root.name, config={"experiment": experiment, "overrides": list(sets),
                                                             "plan": plan_source, "iterations": total,
                                                             "resolved": resolved},
                             first_iteration=start + 1)
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)  # the master takes it over while it runs
    ray = None
    master = None
    try:
        if args.launcher == "external":
            if not run.plan.is_file():
                _prepare_run_dir(run, plan, spec, session, pre, resolved)
            secret = protocol.read_secret()
        else:
            _prepare_run_dir(run, plan, spec, session, pre, resolved)
            secret = _fresh_secret(run)
        # The run's own secret file goes when the master exits, however it exits short of SIGKILL (the
        # finally below, or atexit when interrupted before it). Workers read it only at start, and none
        # outlives the master. Under SLURM the job script removes it too, and a requeued job makes a new one.
        atexit.register(remove_secret, run.secret)
        _truncate_metrics(run.metrics, start)
        if start == 0:
            run.metrics.unlink(missing_ok=True)
        _drop_later_samples(run, start)
        # a fresh run (start 0) in a used run directory replaces its whole history, as a resume replaces what follows
        replaced = [line for d in (run.checkpoints, run.root / "exports")
                    for line in [checkpoint.set_aside_later(d, start)] if line]

        timeouts = {k: v for k, v in (("heartbeat_timeout", args.heartbeat_timeout),
                                      ("call_timeout", args.call_timeout)) if v is not None}
        bind = args.bind
        if args.launcher == "ray":
            from realloc.runtime.launch.ray_launcher import RayLauncher

            ray = RayLauncher(spec.cluster, run, args.ray_address)
            bind = ray.node_ip  # the actors reach the master here (127.0.0.1 for a private local instance)
        from realloc.runtime.control.master import Master

        master = Master(program, config, run, run_id, secret, iterations=total - start, start_iteration=start,
                        resume=ckpt, save_every=args.save_every, export_every=args.export_every,
                        save_final=args.final_checkpoint, keep_checkpoints=args.keep_checkpoints,
                        bind_host=bind, master_port=args.master_port,
                        store_port=args.store_port, stop_signals=stop_signals,
                        verify_checkpoint=not args.skip_checkpoint_checks, schedule_iterations=horizon,
                        secret_file=None if args.launcher == "external" else run.secret, startup=clock,
                        store=local.store if local is not None else None, **timeouts)
        if args.launcher in ("local", "ray"):
            wc = WorkerConfig(experiment=experiment, run_dir=str(run.root), run_id=run_id,
                              world_size=spec.cluster.n_devices, store=f"{bind}:{master.store_port}",
                              master_endpoint=f"tcp://{bind}:{master.port}", device=_device(spec), overrides=sets)
            if ray is not None:
                master.launcher = ray
                ray.start(wc)
            else:
                assert local is not None
                local.start(wc)
                master.launcher, local = local, None
        clock.mark("master")
        print(f"run {run.root}: {spec.name} on {spec.cluster.nodelist} ({spec.cluster.n_devices} devices), "
              f"iterations {start + 1}..{total}, plan {plan_source}")
        if ckpt is not None and args.skip_checkpoint_checks:
            print(f"checkpoint checks skipped (--skip-checkpoint-checks): the files of {ckpt} are read without "
                  f"checking their recorded sizes and SHA-256")
        if sets:
            print(f"overrides: {' '.join(sets)}")
        if reapplied:
            print(f"reapplied the checkpoint's run's overrides: {' '.join(reapplied)}")
        if changed:
            print(f"settings changed from the checkpoint's run (--allow-changed-settings): {'; '.join(changed)}")
        for line in replaced:
            print(line)
        for line in pre.lines:
            print(line)
        if horizon_line:
            print(horizon_line)
        sink_line = sinks.describe()
        if sink_line:
            print(sink_line)
        print(plan.table(graph.topo_order))
        tight = plan.memory_warning(spec.cluster.device_memory)
        if tight:
            print(tight)
        settle_heap()  # the start-up ran without the cyclic collector (cli.entry)
        summary = _drive(master, total, start, sinks, quiet=args.quiet or not sys.stdout.isatty())
    except RunFailed as e:
        print(f"realloc run: error: {e}", file=sys.stderr)
        return master.stop.exit_code if master is not None and master.stop is not None else 1
    finally:
        if local is not None:  # failed before the master took the workers over
            local.stop(grace=KILL_GRACE)
        signal.signal(signal.SIGTERM, previous_sigterm)
        late = _close_all(sinks, ray, run)
    if late is not None:  # the run went well up to its last writes: they are the error
        raise late
    _summary(summary, run, clock)
    if master.stop is not None:
        print(f"realloc run: {master.stop.describe(str(run.root))}", file=sys.stderr)
        return master.stop.exit_code
    return 0


def _close_all(sinks: MetricSinks, ray: Any, run: RunPaths) -> OSError | None:
    """Close the metric sinks and Ray, and remove the secret, whatever fails (a full disk, a read-only run
    directory); never raises, so the run's own error is the one the user sees. Returns the first OSError."""
    first = None
    for close in (sinks.close, *((ray.close,) if ray is not None else ())):
        try:
            close()
        except OSError as e:
            first = first or e
    note = remove_secret(run.secret)
    if note:
        print(f"realloc run: warning: {note}", file=sys.stderr)
    return first


def _prepare_run_dir(run: RunPaths, plan: ExecutionPlan, spec: ExperimentSpec, session: Session,
                     pre: Preflight, resolved: dict[str, Any]) -> None:
    """The run directory with its plan and what ran it (run.json, which ``realloc trace`` and ``--resume`` read,
    and config/: ``records/run_record.py``), and what loading the dataset kept and cut (data.json: the console
    line's counts, for whoever reads the run later)."""
    run.root.mkdir(parents=True, exist_ok=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    plan.save(run.plan)
    write_run_record(run.root, spec, session, resolved=resolved)
    if pre.data is not None:
        with naming(run.data):
            run.data.write_text(json.dumps(data_record(pre.data, spec), indent=2))


def slurm_options(args: argparse.Namespace) -> SlurmOptions:
    def one_or_per_pool(values: list[str] | None) -> str | tuple[str, ...] | None:
        return None if not values else values[0] if len(values) == 1 else tuple(values)

    return SlurmOptions(partition=one_or_per_pool(args.partition), account=args.account, time_limit=args.time,
                        job_name=args.job_name, extra_sbatch=tuple(args.sbatch), setup=tuple(args.setup),
                        srun_args=tuple(args.srun_arg), cpus_per_task=args.cpus_per_task,
                        nodelist=one_or_per_pool(args.nodelist), python=args.python, mem=args.mem,
                        gres=one_or_per_pool(args.gres))


def _check_local(spec: ExperimentSpec) -> None:
    """The local launcher runs every worker on this machine: refuse clusters it cannot be."""
    c = spec.cluster
    if c.hardware.kind == "cpu":
        return  # CPU "devices" are processes; any nodelist can be simulated here
    hint = "submit it with --launcher slurm (add --dry-run to see the script)"
    if c.pools:  # every pool's devices on this machine: rank r on GPU r (LocalLauncher, pool_launch.py)
        import torch

        if torch.cuda.device_count() < c.n_devices:
            raise ValueError(f"cluster {c.nodelist!r} has {len(c.pools)} pools of {c.n_devices} GPUs in all, but this "
                             f"machine has {torch.cuda.device_count()}; {hint}")
        return
    if c.n_nodes > 1:
        raise ValueError(f"cluster {c.nodelist!r} spans {c.n_nodes} nodes; the local launcher runs on this machine "
                         f"only; {hint}")
    import torch

    if torch.cuda.device_count() < c.n_devices_per_node:
        raise ValueError(f"cluster {c.nodelist!r} needs {c.n_devices_per_node} {c.device} GPUs but this machine has "
                         f"{torch.cuda.device_count()}; {hint}")


def _device(spec: ExperimentSpec) -> str:
    return "cpu" if spec.cluster.hardware.kind == "cpu" else "cuda"  # pools: all CPU or all GPU (check_pools)


def _drive(master: Any, total: int, start: int, sinks: MetricSinks, quiet: bool,
           long_call: float = LONG_CALL_S) -> dict[str, Any]:
    """Run the master, printing each iteration's line and the progress inside iterations (``progress.py``):
    a rich bar whose status names the running calls and the ETA on a terminal, plain lines otherwise."""
    from realloc.runtime.records.telemetry import format_line

    progress = RunProgress(total, start, long_call=long_call)
    if quiet:
        def on_line(m: dict[str, Any]) -> None:
            progress.iteration_done()
            print(f"{format_line(m, total)} | {progress.eta_text()}", flush=True)
            sinks.write(m)

        def on_node(label: str, iteration: int, seconds: float | None) -> None:
            line = progress.node(label, iteration, seconds)
            if line:
                print(line, flush=True)

        def tick() -> None:
            for line in progress.long_lines():
                print(line, flush=True)

        print(f"starting {master.n_workers} workers (importing, loading models and data)", flush=True)
        master.on_iteration, master.on_node = on_line, on_node
        master.on_ready = lambda: print(progress.workers_ready(), flush=True)
        return asyncio.run(_with_ticker(master, tick))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    with Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console, transient=True) as bar:
        task = bar.add_task("iterations", total=total, completed=start, status="starting workers")

        def on_iteration(m: dict[str, Any]) -> None:
            progress.iteration_done()
            console.print(format_line(m, total))
            sinks.write(m)
            bar.update(task, advance=1, status=progress.status())

        def on_node_bar(label: str, iteration: int, seconds: float | None) -> None:
            progress.node(label, iteration, seconds)
            bar.update(task, status=progress.status())

        master.on_iteration, master.on_node = on_iteration, on_node_bar
        master.on_ready = lambda: (progress.workers_ready(), bar.update(task, status=progress.status()))
        return asyncio.run(_with_ticker(master, lambda: bar.update(task, status=progress.status())))


async def _with_ticker(master: Any, tick: Any, every: float = 1.0) -> dict[str, Any]:
    """``master.run()``, calling ``tick()`` every ``every`` seconds while it runs (the running calls' times)."""
    async def ticker() -> None:
        while True:
            await asyncio.sleep(every)
            tick()

    task = asyncio.create_task(ticker())
    try:
        return await master.run()
    finally:
        task.cancel()


def _summary(summary: dict[str, Any], run: RunPaths, clock: StartupClock) -> None:
    if not summary:
        return
    summary = {**summary, "startup": clock.report()}
    with naming(run.root / "summary.json"):
        (run.root / "summary.json").write_text(json.dumps(summary, indent=2))
    clock.write(run.root / "startup.json")
    line = f"done: {summary['iterations']} iterations, {summary['iteration_time']:.2f} s/iteration (after the first)"
    if summary.get("last_reward") is not None:
        line += f", reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}"
    if summary.get("staleness"):
        line += f", staleness max {summary['staleness']['max']} mean {summary['staleness']['mean']:.2f}"
    shares = summary["device_time_shares"]
    line += f", reallocation {shares.get('realloc', 0.0):.1%} of device time"
    if summary["overhead"]:
        line += f", master overhead {summary['overhead']['mean_overhead_s'] * 1e3:.1f} ms/request"
    print(line)
    print(clock.line())
    print(f"metrics {run.metrics}\ntrace   {run.trace} (open in chrome://tracing or ui.perfetto.dev)")
