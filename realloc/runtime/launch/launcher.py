"""Start the model workers: local subprocesses, or a SLURM job.

Rendezvous goes through a torch.distributed ``TCPStore`` hosted by the master (never a shared
filesystem): workers learn its address from their command line, build the gloo/NCCL world on it,
and connect to the master's ZMQ socket. Local runs bind everything to 127.0.0.1.

The run secret (see ``protocol.py``) is a 0600 file in the run directory, named to the workers by
``$REALLOC_SECRET_FILE``; it is never on a command line, in the SLURM script or on the wire.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from realloc.atomic_file import write_text_atomically
from realloc.cluster import ClusterSpec
from realloc.estimator.hardware import PROFILES_ENV
from realloc.cluster import LOCAL_DEVICE_ENV
from realloc.runtime.control.stop_signals import StopSignals
from realloc.runtime.control.store_listener import StoreListener
from realloc.runtime.launch.pool_launch import (check_pools, is_gpu, per_pool, sbatch_components, slurm_job_nodes,
                                                slurm_worker_steps)
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.records.startup import ARGS_FROM_STDIN
from realloc.runtime.wire.protocol import SECRET_FILE_ENV

WORKER_MODULE = "realloc.runtime.control.worker_main"  # worker.main, its start-up without the cyclic collector


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs besides its rank; it derives models and groups from the plan itself."""

    experiment: str  # path/to/exp.py[:Class], imported by the worker
    run_dir: str
    run_id: str
    world_size: int
    store: str  # host:port of the rendezvous TCPStore
    master_endpoint: str  # tcp://host:port of the master's ZMQ ROUTER
    device: str  # "cpu" or "cuda"
    python: str = sys.executable
    overrides: tuple[str, ...] = ()  # the run's --set KEY=VALUE items, applied to the experiment

    def worker_args(self, rank: int | str) -> list[str]:
        """The arguments of ``realloc.runtime.control.worker.main``."""
        sets = [x for item in self.overrides for x in ("--set", item)]
        return ["--experiment", self.experiment, "--run-dir", self.run_dir, "--run-id", self.run_id,
                "--rank", str(rank), "--world-size", str(self.world_size), "--store", self.store,
                "--master", self.master_endpoint, "--device", self.device, *sets]

    def argv(self, rank: int | str) -> list[str]:
        return [self.python, "-m", WORKER_MODULE, *self.worker_args(rank)]


def worker_env(run: RunPaths, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[SECRET_FILE_ENV] = str(run.secret)
    # One thread per worker process: a worker is one "device" (DEVELOPERS.md).
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # torch writes scratch folders into $TMPDIR; keep them inside the run.
    env["TMPDIR"] = str(run.tmp)
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launching master dies (Linux), so no worker outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the worker's heartbeat timeout still ends it


class LocalLauncher:
    """One subprocess per device on this machine.

    The processes start before the master knows its plan (``prestart``, while it loads the experiment and
    searches): Python, torch and megatron load meanwhile, the largest part of a worker's start-up. Each then
    waits for its arguments on stdin (``--args-from-stdin``), which ``start`` writes once the master listens.
    A worker whose stdin closes without them (the master stopped first) exits at once."""

    one_machine = True  # every plan node on this machine (the master's host check allows it on GPUs too)

    def __init__(self, run: RunPaths, world_size: int, python: str = sys.executable,
                 store: StoreListener | None = None) -> None:
        self.run = run
        self.world_size = world_size
        self.python = python
        # With ``store``, worker 0 serves the rendezvous on the master's listening socket (store_listener.py).
        self.store = store
        self.procs: dict[int, subprocess.Popen] = {}
        self._logs: list = []

    def prestart(self) -> None:
        self.run.logs.mkdir(parents=True, exist_ok=True)
        self.run.tmp.mkdir(parents=True, exist_ok=True)
        env = worker_env(self.run)
        if sys.platform == "linux":
            # Keep the workers' own collective sockets on loopback too (gloo and NCCL's bootstrap would
            # otherwise use the interface the hostname resolves to).
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        for rank in range(self.world_size):
            log = open(self.run.worker_log(rank), "ab")
            self._logs.append(log)
            env[LOCAL_DEVICE_ENV] = str(rank)  # on GPUs, GPU r of this machine (one machine hosts every node here)
            serves = self.store is not None and rank == 0
            self.procs[rank] = subprocess.Popen([self.python, "-m", WORKER_MODULE, ARGS_FROM_STDIN], env=dict(env),
                                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                                start_new_session=True,
                                                pass_fds=(self.store.fileno(),) if serves else (),
                                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def start(self, config: WorkerConfig) -> None:
        """Hand every worker its arguments (starting the processes first if ``prestart`` did not)."""
        if config.world_size != self.world_size:
            raise ValueError(f"the launcher has {self.world_size} workers; the run needs {config.world_size}")
        if not self.procs:
            self.prestart()
        for rank, p in sorted(self.procs.items()):
            assert p.stdin is not None
            try:
                serves = ["--store-fd", str(self.store.fileno())] if self.store is not None and rank == 0 else []
                p.stdin.write(json.dumps(config.worker_args(rank) + serves).encode() + b"\n")
                p.stdin.close()
            except BrokenPipeError:
                pass  # it died while importing: the master's monitor reports its exit code and log
        if self.store is not None:
            self.store.close()  # worker 0 holds the socket now

    def pid(self, rank: int) -> int | None:
        p = self.procs.get(rank)
        return p.pid if p else None

    def dead(self) -> dict[int, int]:
        """Workers that have exited, with their exit codes."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def stop(self, grace: float = 5.0, hung: Iterable[int] = ()) -> None:
        """Ask every worker to stop, then kill whatever is left after ``grace`` seconds; ``hung`` workers
        (known not to respond) are killed at once."""
        hung = set(hung)
        alive = [p for p in self.procs.values() if p.poll() is None]
        for r, p in self.procs.items():
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL if r in hung else signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def wait_exit(self, timeout: float) -> bool:
        """Wait for every worker to exit on its own; True if they all did within ``timeout``."""
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its own session: this reaches its children too
    except (ProcessLookupError, PermissionError):
        pass


# -- SLURM ------------------------------------------------------------------------------------------------------
# Rendezvous ports derive from the job id, in [PORT_BASE, PORT_BASE + 2 * PORT_SLOTS): below Linux's
# ephemeral range (32768-60999 by default), where the kernel picks outgoing connections' ports.
PORT_BASE = 20000
PORT_SLOTS = 6000


def slurm_ports(job_id: int) -> tuple[int, int]:
    """(store port, master port) of a SLURM job, as its script computes them."""
    store = PORT_BASE + 2 * (job_id % PORT_SLOTS)
    return store, store + 1


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    """What a user sets for their cluster (``realloc run --launcher slurm`` options)."""

    # partition, nodelist and gres: one value for every pool, or (a tuple) one per pool of a cluster of pools
    partition: str | tuple[str, ...] | None = None
    account: str | None = None
    time_limit: str = "24:00:00"
    job_name: str = "realloc"
    extra_sbatch: tuple[str, ...] = ()  # more #SBATCH options, e.g. "--qos=high"
    setup: tuple[str, ...] = ()  # shell lines before anything starts: module load, conda activate, ...
    srun_args: tuple[str, ...] = ()  # e.g. "--container-image=..." (pyxis) for the workers' step
    cpus_per_task: int | None = None  # None: the whole node (--exclusive), split evenly among its devices
    nodelist: str | tuple[str, ...] | None = None  # pin the job to these hosts; by default SLURM picks any free nodes
    # The interpreter of the master and the workers inside the job. None: this one (its absolute path) for a
    # job in this environment; ``python3`` from the job's PATH when --setup lines or a container image make
    # another environment, where this machine's path may not exist or be another installation.
    python: str | None = None
    mem: str | None = None  # #SBATCH --mem (memory per node, e.g. 200G; 0 is all of it)
    gres: str | tuple[str, ...] | None = None  # #SBATCH --gres for the GPUs (e.g. gpu:a100:8) instead of --gpus-per-node

    def __post_init__(self) -> None:
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"--cpus-per-task must be a positive integer, got {self.cpus_per_task}")
        if self.python is not None and not self.python.strip():
            raise ValueError("--python is empty; give an interpreter, e.g. --python python3 or --python "
                             "/opt/venv/bin/python")
        if self.python is None:
            elsewhere = bool(self.setup) or any(a.lstrip("-").startswith("container") for a in self.srun_args)
            object.__setattr__(self, "python", "python3" if elsewhere else sys.executable)
        if not _TIME.fullmatch(self.time_limit.strip()):  # else sbatch refuses the script after it is written
            raise ValueError(f"--time {self.time_limit!r}: give SLURM's form MINUTES, MINUTES:SECONDS, HOURS:MINUTES:"
                             f"SECONDS or DAYS-HOURS[:MINUTES[:SECONDS]] (e.g. 24:00:00 or 2-00:00:00), or UNLIMITED")
        if self.mem is not None and not _MEM.fullmatch(self.mem.strip()):
            raise ValueError(f"--mem {self.mem!r}: give SLURM's form, a number with an optional unit K, M, G or T "
                             f"(e.g. 200G; 0 asks for all of a node's memory)")
        for gres in self.gres if isinstance(self.gres, tuple) else (self.gres,):
            if gres is not None and not _GRES.fullmatch(gres.strip()):
                raise ValueError(f"--gres {gres!r}: give SLURM's form NAME[:TYPE][:COUNT], e.g. gpu:8 or gpu:a100:8")

    def check(self, cluster: ClusterSpec) -> None:
        """The options that depend on the cluster: one error before anything is written or submitted."""
        check_pools(cluster)
        per_pool(self.partition, cluster, "--partition")
        per_pool(self.nodelist, cluster, "--nodelist")
        for c, gres in zip(cluster.pools or (cluster,), per_pool(self.gres, cluster, "--gres")):
            if gres is None:
                continue
            if c.hardware.kind == "cpu":
                raise ValueError(f"--gres {gres!r}: cluster {c.nodelist!r} runs on CPUs and needs no GPUs; "
                                 f"other resources go in --sbatch gres=...")
            _gres_line(gres, c.n_devices_per_node)
        object.__setattr__(self, "extra_sbatch", tuple(_long_option(x) for x in self.extra_sbatch))
        object.__setattr__(self, "srun_args", tuple(_long_option(x) for x in self.srun_args))


_MEM = re.compile(r"\d+[KMGT]?B?", re.IGNORECASE)
_TIME = re.compile(r"\d+(-\d+)?(:\d+){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)  # sbatch(1), --time
_GRES = re.compile(r"[A-Za-z][\w.-]*(:[\w.-]+)*")


def _gres_line(gres: str, n_gpus: int) -> str:
    """``#SBATCH --gres`` for ``n_gpus`` per node: ``gpu`` or ``gpu:a100`` get the count added; a count given
    must be the plan's devices per node (one worker per device)."""
    parts = gres.strip().split(":")
    if parts[0] != "gpu":
        raise ValueError(f"--gres {gres!r}: the GPUs are requested as gpu[:TYPE][:COUNT], e.g. gpu:{n_gpus}; other "
                         f"resources go in --sbatch gres=...")
    if parts[-1].isdigit():
        if int(parts[-1]) != n_gpus:
            raise ValueError(f"--gres {gres!r} asks for {parts[-1]} GPUs per node, but the cluster's nodes run "
                             f"{n_gpus} workers each (one per GPU); give gpu:{n_gpus} or leave the count out")
        return f"#SBATCH --gres={gres.strip()}"
    return f"#SBATCH --gres={gres.strip()}:{n_gpus}"


def _long_option(text: str) -> str:
    """``qos=high`` and ``--qos=high`` both mean ``--qos=high`` (argparse cannot take a value starting with --)."""
    text = text.strip()
    if not text:
        raise ValueError("an empty --sbatch/--srun-arg option")
    return text if text.startswith("-") else "--" + text


def slurm_script(cluster: ClusterSpec, experiment: str, run: RunPaths, run_id: str, master_args: list[str],
                 opts: SlurmOptions = SlurmOptions(), overrides: tuple[str, ...] = (),
                 stop_signals: StopSignals = StopSignals(), profiles: str | None = None) -> str:
    """The sbatch script of a run: the master on the first node, one worker task per device, both via srun.

    ``master_args`` are the ``realloc run`` arguments the master repeats inside the job (plan,
    iterations, checkpoints); the script adds ``--launcher external`` and the rendezvous address.
    Plans name nodes by index: node i of the plan is the i-th node SLURM allocated (block distribution
    puts ranks i*n .. i*n+n-1 there), so the user need not know the host names before submitting.
    The master is a one-task step on the batch node (``--overlap``: it shares the workers' CPUs) with the
    same ``srun_args``, so a container image or other step environment holds for it too. ``profiles``
    (``--profiles DIR``) is exported as ``$REALLOC_PROFILES`` to the master and the workers.
    """
    gpu = is_gpu(cluster)
    q = shlex.quote
    opts.check(cluster)
    nodelists, gres, partitions = (per_pool(v, cluster, o) for v, o in ((opts.nodelist, "--nodelist"),
                                                                       (opts.gres, "--gres"),
                                                                       (opts.partition, "--partition")))

    def resources(c: ClusterSpec, i: int) -> list[str]:
        """A pool's (or the one-kind cluster's) nodes, tasks, CPUs, GPUs, memory and partition."""
        n = c.n_devices_per_node
        out = [f"#SBATCH --nodes={c.n_nodes}", f"#SBATCH --ntasks-per-node={n}"]
        if cluster.pools:  # a heterogeneous job: each component has its own limits (SLURM's hetjob)
            out.append(f"#SBATCH --time={opts.time_limit}")
        if nodelists[i]:
            out.append(f"#SBATCH --nodelist={nodelists[i]}")
        out.append(f"#SBATCH --cpus-per-task={opts.cpus_per_task}" if opts.cpus_per_task is not None
                   else "#SBATCH --exclusive")
        if gres[i] is not None:
            out.append(_gres_line(gres[i], n))
        elif c.hardware.kind != "cpu":
            out.append(f"#SBATCH --gpus-per-node={n}")
        if opts.mem is not None:
            out.append(f"#SBATCH --mem={opts.mem.strip()}")
        if partitions[i]:
            out.append(f"#SBATCH --partition={partitions[i]}")
        return out

    head = ["#!/bin/bash", f"#SBATCH --job-name={opts.job_name}"]
    tail = [f"#SBATCH --output={run.logs}/slurm-%j.out", stop_signals.sbatch_directive()]
    common = ([f"#SBATCH --account={opts.account}"] if opts.account else []) + [f"#SBATCH {x}" for x in opts.extra_sbatch]
    if cluster.pools:
        lines = head + tail + sbatch_components(cluster, resources, common)
    else:  # one kind: today's script, line for line
        r = resources(cluster, 0)
        lines = head + r[:2] + [f"#SBATCH --time={opts.time_limit}"] + tail + r[2:] + common
    worker = WorkerConfig(experiment=experiment, run_dir=str(run.root), run_id=run_id,
                          world_size=cluster.n_devices, store="$MASTER_HOST:$STORE_PORT",
                          master_endpoint="tcp://$MASTER_HOST:$MASTER_PORT", device="cuda" if gpu else "cpu",
                          python=opts.python, overrides=overrides)
    # Expanded by each task's shell: its own $SLURM_PROCID, and the exported master address.
    placeholders = (worker.store, worker.master_endpoint)
    master_cmd = " ".join([q(opts.python), "-m", "realloc.cli", "run", q(experiment), *map(q, master_args),
                           "--run-dir", q(str(run.root)), "--run-id", q(run_id), "--launcher", "external",
                           "--bind", "0.0.0.0", "--store-port", "$STORE_PORT", "--master-port", "$MASTER_PORT"])
    master_srun = ["srun", *(["--het-group=0"] if cluster.pools else []), "--nodes=1", "--ntasks=1", "--overlap",
                   '--nodelist="${JOB_NODES[0]}"', *map(q, opts.srun_args)]
    plan_nodes = " ".join(q(x) for x in cluster.nodes)
    warn = stop_signals.warning.name.removeprefix("SIG")
    secret = f'"${SECRET_FILE_ENV}"'
    lines += ["set -uo pipefail", *opts.setup,
              f"export {SECRET_FILE_ENV}={q(str(run.secret))}",
              "# The secret lives as long as the job: removed when this script exits (cancel and the time limit",
              "# included); a requeued job makes a fresh one (0600, 32 random bytes in hex).",
              f"[ -f {secret} ] || (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \\n' > {secret})",
              f"trap 'rm -f {secret}' EXIT",
              "export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1",
              "export MASTER_HOST=$(hostname)",
              "# Node i of the plan is the i-th allocated node; record the mapping for the logs and the master.",
              f"PLAN_NODES=({plan_nodes})",
              *slurm_job_nodes(cluster),
              'if [ "${#JOB_NODES[@]}" -ne "${#PLAN_NODES[@]}" ]; then',
              '  echo "realloc: the plan has ${#PLAN_NODES[@]} nodes but SLURM allocated ${#JOB_NODES[@]}" >&2; exit 2',
              "fi",
              'for i in "${!PLAN_NODES[@]}"; do echo "plan node $i (${PLAN_NODES[$i]}) -> ${JOB_NODES[$i]}"; done',
              'export REALLOC_JOB_NODES="${JOB_NODES[*]}"',
              *([f"export {PROFILES_ENV}={q(profiles)}"] if profiles else []),
              "# Ports derive from the job id (below the ephemeral range), so nothing but the store is needed to "
              "rendezvous.",
              f"export STORE_PORT=$(( {PORT_BASE} + 2 * (SLURM_JOB_ID % {PORT_SLOTS}) ))",
              "export MASTER_PORT=$(( STORE_PORT + 1 ))",
              "# Cancel and the time limit send SIGTERM to every process, the master included; the warning signal",
              "# comes to this script only, which passes it on. Either way the master finishes the iterations in",
              "# flight, saves a checkpoint if there is time and exits; this script waits for it.",
              "MASTER_PID=",
              f"trap '[ -n \"$MASTER_PID\" ] && kill -{warn} $MASTER_PID 2>/dev/null' {warn}",
              "trap 'echo \"realloc: SIGTERM; the master stops the run\" >&2' TERM",
              "# The master hosts the rendezvous store and the ZMQ socket; it exits non-zero on any failure.",
              "# It runs as a step on this node (the first allocated) in the workers' environment; srun passes",
              "# signals on to it.",
              f"{' '.join(master_srun)} {master_cmd} &",
              "MASTER_PID=$!",
              "# One worker per device; --kill-on-bad-exit ends the step when one fails, the master reports it.",
              *slurm_worker_steps(cluster, worker.argv, placeholders, opts.srun_args, opts.cpus_per_task),
              "# A trapped signal interrupts wait: keep waiting until the master has exited.",
              "while :; do wait $MASTER_PID; STATUS=$?; kill -0 $MASTER_PID 2>/dev/null || break; done",
              "kill $SRUN_PIDS 2>/dev/null || true",
              "exit $STATUS",
              ""]
    return "\n".join(lines)


def write_job_script(script: str, run: RunPaths) -> Path:
    path = run.root / "job.sbatch"
    write_text_atomically(path, script)  # never half a script to submit (a full disk names the file)
    return path


def submit_slurm(script: str, run: RunPaths) -> str:
    """Write the script into the run directory and submit it; returns sbatch's job id."""
    path = write_job_script(script, run)
    try:
        out = subprocess.run(["sbatch", "--parsable", str(path)], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise ValueError("sbatch is not installed on this machine; run `realloc run ... --launcher slurm "
                         "--dry-run` to print the script and submit it where SLURM is available") from None
    except subprocess.CalledProcessError as e:
        raise ValueError(f"sbatch failed: {e.stderr.strip() or e.stdout.strip()}") from None
    return out.stdout.strip().split(";")[0]
