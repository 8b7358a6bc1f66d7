"""``realloc run --launcher ray``: the model workers as Ray actors, the master as the Ray driver.

One actor per device, placed by a placement group that mirrors the plan's nodes: bundle i holds
node i's devices ({"GPU": n, "CPU": n}, or {"CPU": n} for CPU devices), and the actor of rank r
goes to bundle r // n (on a cluster of pools, each node its pool's size and, for GPU kinds Ray knows, its
``accelerator_type``: ``pool_launch.py``). On GPUs the bundles are spread over distinct Ray nodes (``STRICT_SPREAD``),
so node i of the plan is one machine, as the cost model assumed; KubeRay clusters work the same way.

Each actor runs the ordinary worker (``realloc.runtime.control.worker.main``) with the same command line as
a local or SLURM worker: Ray only places and starts the processes. Everything else (rendezvous on the
master's TCPStore, signed ZMQ messages, NCCL/gloo) is unchanged, so a Ray run gives the same metrics
as a local one with the same plan and seed. The run directory (plan, secret) must be on a filesystem
every Ray node sees, as for SLURM.

``--ray-address`` (or ``$RAY_ADDRESS``) names the cluster; without one, Ray starts a private local
instance bound to 127.0.0.1 for the run.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Iterable

from realloc.cluster import ClusterSpec
from realloc.runtime.launch.launcher import WorkerConfig, worker_env
from realloc.runtime.launch.pool_launch import is_gpu, ray_bundles
from realloc.runtime.records.run_paths import RunPaths

# Passed to the actors: the worker's own settings and how to import realloc there.
FORWARDED_ENV = ("PYTHONPATH", "REALLOC_PROFILES", "REALLOC_DEBUG", "REALLOC_COLLECTIVE_SPIN_MS")


class WorkerActor:
    """Runs one model worker in the actor's process (wrapped with ``ray.remote`` at start)."""

    def where(self) -> tuple[int, str]:
        return os.getpid(), socket.gethostname()

    def run(self, argv: list[str], log_path: str) -> int:
        """The worker, its output into the run's ``logs/worker<r>.log`` as a local worker's is."""
        import ray

        from realloc.runtime.control import worker

        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        ctx = ray.get_runtime_context()
        print(f"Ray actor {ctx.get_actor_id()} on node {ctx.get_node_id()} ({socket.gethostname()})", flush=True)
        return worker.main(argv)


LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is 127.0.0.1 (read at import)


def _ray(local: bool) -> Any:
    if local:
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    try:
        import ray
    except ImportError:
        raise ValueError("--launcher ray needs the ray package: pip install 'realloc[ray]'") from None
    if local and os.environ.get(LOCAL_ONLY_ENV) == "0":
        # Ray reads the variable when it is first imported; if something imported it before us, set what the
        # variable sets, or the private instance would listen on the machine's network address.
        constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
        if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
            constants.ENABLE_RAY_CLUSTER = False
    return ray


class RayLauncher:
    """Same interface as ``LocalLauncher``: start, pid, dead, stop, wait_exit."""

    def __init__(self, cluster: ClusterSpec, run: RunPaths, address: str | None = None) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS")
        ray = _ray(local=not self.address)
        self.cluster = cluster
        self.run = run
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:  # a private instance for this run, on loopback only
                ray.init(num_cpus=max(cluster.n_devices, 1), include_dashboard=False, log_to_driver=False)
        self.ray = ray
        self.actors: dict[int, Any] = {}
        self.refs: dict[int, Any] = {}
        self.pids: dict[int, int] = {}
        self.hosts: dict[int, str] = {}
        self.codes: dict[int, int] = {}
        self.pg: Any = None

    @property
    def node_ip(self) -> str:
        """The driver's address as the Ray nodes reach it: where the master binds its sockets."""
        return self.ray.util.get_node_ip_address()

    def start(self, config: WorkerConfig, timeout: float = 300.0) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.cluster
        gpu = is_gpu(c)
        bundles = ray_bundles(c)  # one per plan node; pools: each its own size and kind (pool_launch.py)
        strategy = "STRICT_SPREAD" if gpu and c.n_nodes > 1 else "PACK"
        self.pg = placement_group(bundles, strategy=strategy, name=f"realloc-{config.run_id}")
        ready, _ = self.ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            have = self.ray.cluster_resources()
            shown = bundles[0] if all(b == bundles[0] for b in bundles) else bundles
            raise ValueError(f"Ray could not place {c.n_nodes} node(s) of {shown} ({strategy}) within "
                             f"{timeout:.0f} s; the cluster has {have}")
        self.run.logs.mkdir(parents=True, exist_ok=True)
        self.run.tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in worker_env(self.run, base={}).items()}
        env.update({k: os.environ[k] for k in FORWARDED_ENV if k in os.environ})
        if self.node_ip.startswith("127."):
            env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")  # keep a local run on loopback
        remote = self.ray.remote(WorkerActor)
        for rank in range(c.n_devices):
            actor = remote.options(
                num_cpus=1, num_gpus=1 if gpu else 0, name=f"realloc-{config.run_id}-worker{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=c.node_of(rank)),
                runtime_env={"env_vars": env}).remote()
            self.actors[rank] = actor
        where = self.ray.get([a.where.remote() for a in self.actors.values()], timeout=timeout)
        for rank, (pid, host) in zip(self.actors, where):
            self.pids[rank], self.hosts[rank] = pid, host
        for rank, actor in self.actors.items():
            self.refs[rank] = actor.run.remote(config.worker_args(rank), str(self.run.worker_log(rank)))

    def pid(self, rank: int) -> int | None:
        return self.pids.get(rank)

    def dead(self) -> dict[int, int]:
        """Workers whose actor call has ended, with an exit code (0 after a clean shutdown)."""
        for rank, ref in self.refs.items():
            if rank in self.codes:
                continue
            ready, _ = self.ray.wait([ref], timeout=0)
            if ready:
                try:
                    self.codes[rank] = int(self.ray.get(ref) or 0)
                except Exception:  # noqa: BLE001 - the actor died (killed, crashed or os._exit)
                    self.codes[rank] = 1
        return dict(self.codes)

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        pending = [r for r in self.refs.values()]
        ready, _ = self.ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
        return len(ready) == len(pending)

    def stop(self, grace: float = 5.0, hung: Iterable[int] = ()) -> None:
        """Kill every actor (at once; ``hung`` makes no difference here)."""
        for actor in self.actors.values():
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None
        self.actors.clear()

    def close(self) -> None:
        """Release the actors and disconnect (a private local instance shuts down with it)."""
        self.stop()
        self.ray.shutdown()
