"""Launching a cluster of pools (issue 32, docs/heterogeneous.md): which worker runs where, under every launcher.

A cluster of pools numbers its devices pool by pool (pool 0's first), and node i of the plan is the i-th node
of that order, whatever its pool. Each launcher keeps that numbering:

- SLURM: a heterogeneous job, one component per pool (its own node count, tasks per node, GPUs and, given per
  pool, partition, ``--gres`` and nodelist), and one worker step per pool (``srun --het-group=i``) whose task j
  is rank ``pool offset + j``. The job's nodes are the components' nodes in pool order.
- Ray: one placement-group bundle per plan node with that node's own device count; on GPU pools of several
  kinds, each bundle also asks for Ray's ``accelerator_type:<T>`` resource of its pool's kind where Ray
  knows the kind, so a V100 pool's workers do not land on an A100 node.
- Local: every worker on this machine, rank r on local device r (GPU pools need that many GPUs here).

Each worker takes its pool's kind and dtype from the plan (``RuntimeProgram.dtype_of``), NCCL on GPUs and gloo on
CPUs as on one pool, and reallocations across pools cast on receive (``control/pool_dtypes.py``). What is
refused: pools of CPU kinds beside pools of GPU kinds in one run (one collective world is NCCL or gloo, and NCCL
moves device memory only).
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Callable

from realloc.cluster import ClusterSpec

# Ray's own accelerator names (``ray.util.accelerators``), which Ray detects on a node and offers as the resource
# ``accelerator_type:<name>``. Kinds missing here (a10-24g: Ray tells A10 and A10G apart by name only) are placed
# by GPU count alone.
RAY_ACCELERATORS = {"a100-80g": "A100", "h100-80g": "H100", "h200-141g": "H200", "h20-96g": "H20",
                    "v100-32g": "V100", "l40s-48g": "L40S"}
LABEL = 0.001  # a bundle's share of the node's accelerator_type resource: a label, not a count


@dataclasses.dataclass(frozen=True)
class NodeBlock:
    """Plan node ``node``: in pool ``pool``, its devices are ranks ``first_rank .. first_rank + n_devices - 1``."""

    node: int
    pool: int
    first_rank: int
    n_devices: int
    kind: str
    gpu: bool


def node_blocks(cluster: ClusterSpec) -> list[NodeBlock]:
    out: list[NodeBlock] = []
    for pool, (p, offset) in enumerate(zip(cluster.pools or (cluster,), cluster.pool_offsets)):
        for i in range(p.n_nodes):
            out.append(NodeBlock(len(out), pool, offset + i * p.n_devices_per_node, p.n_devices_per_node, p.device,
                                 p.hardware.kind != "cpu"))
    return out


def check_pools(cluster: ClusterSpec) -> None:
    """One line for what no launcher runs: CPU pools beside GPU pools."""
    if not cluster.pools:
        return
    gpu = {p.hardware.kind != "cpu" for p in cluster.pools}
    if len(gpu) > 1:
        kinds = ", ".join(f"pool {i} ({p.device}, {'GPU' if p.hardware.kind != 'cpu' else 'CPU'})"
                          for i, p in enumerate(cluster.pools))
        raise ValueError(f"cluster {cluster.nodelist!r} mixes CPU and GPU pools ({kinds}); realloc run runs pools "
                         f"that are all GPUs (NCCL) or all CPUs (gloo): one collective world cannot be both; plan "
                         f"it with realloc search, or run the GPU pools alone")


def is_gpu(cluster: ClusterSpec) -> bool:
    return any(b.gpu for b in node_blocks(cluster))


# -- Ray ---------------------------------------------------------------------------------------------------------
def ray_bundles(cluster: ClusterSpec) -> list[dict[str, float]]:
    """One bundle per plan node (actor of rank r goes to bundle ``cluster.node_of(r)``)."""
    kinds = {b.kind for b in node_blocks(cluster) if b.gpu}
    out = []
    for b in node_blocks(cluster):
        bundle = {"CPU": float(b.n_devices), **({"GPU": float(b.n_devices)} if b.gpu else {})}
        if len(kinds) > 1 and b.kind in RAY_ACCELERATORS:
            bundle[f"accelerator_type:{RAY_ACCELERATORS[b.kind]}"] = LABEL
        out.append(bundle)
    return out


# -- SLURM -------------------------------------------------------------------------------------------------------
def per_pool(value: str | tuple[str, ...] | None, cluster: ClusterSpec, option: str) -> list[str | None]:
    """An option given once (every pool) or once per pool, as the list of each pool's value."""
    k = len(cluster.pools) or 1
    if not isinstance(value, tuple):
        return [value] * k
    if len(value) == 1:
        return [value[0]] * k
    if len(value) != k:
        raise ValueError(f"{option} is given {len(value)} times, but cluster {cluster.nodelist!r} has {k} pool(s); "
                         f"give it once (every pool) or once per pool, in pool order")
    return list(value)


def sbatch_components(cluster: ClusterSpec, resources: Callable[[ClusterSpec, int], list[str]],
                      common: list[str]) -> list[str]:
    """The #SBATCH lines of a job of pools: one component per pool, separated by ``#SBATCH hetjob``.
    ``resources(pool, i)`` gives a pool's node, task and GPU lines; ``common`` goes into every component."""
    lines: list[str] = []
    for i, p in enumerate(cluster.pools):
        if i:
            lines.append("#SBATCH hetjob")
        lines += resources(p, i) + common
    return lines


def slurm_job_nodes(cluster: ClusterSpec) -> list[str]:
    """Shell lines filling ``JOB_NODES`` with the job's hosts in plan order (components in pool order)."""
    if not cluster.pools:
        return ['mapfile -t JOB_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")']
    return ["JOB_NODES=()"] + [f'mapfile -t -O "${{#JOB_NODES[@]}}" JOB_NODES < <(scontrol show hostnames '
                               f'"$SLURM_JOB_NODELIST_HET_GROUP_{i}")' for i in range(len(cluster.pools))]


def slurm_worker_steps(cluster: ClusterSpec, argv: Callable[[str], list[str]], placeholders: tuple[str, ...],
                       srun_args: tuple[str, ...], cpus_per_task: int | None) -> list[str]:
    """The workers' steps: one for a one-kind cluster; one per pool (``--het-group``) for pools, whose task j is
    rank ``offset + j``. Each line ends in ``&`` and adds its pid to ``SRUN_PIDS``."""
    q = shlex.quote
    pools = list(enumerate(zip(cluster.pools or (cluster,), cluster.pool_offsets)))
    lines = ["SRUN_PIDS="]
    for i, (p, offset) in pools:
        n = p.n_devices_per_node
        rank = "$SLURM_PROCID" if not cluster.pools else f"$(( {offset} + SLURM_PROCID ))"
        inner = " ".join(f'"{a}"' if a in placeholders + (rank,) else q(a) for a in argv(rank))
        if cpus_per_task is not None:
            cpus = f"--cpus-per-task={cpus_per_task}"
        elif not cluster.pools:
            cpus = f"--cpus-per-task=$(( ${{SLURM_CPUS_ON_NODE:-{n}}} / {n} > 0 ? ${{SLURM_CPUS_ON_NODE:-{n}}} / {n} : 1 ))"
        else:  # the component's CPUs per node: SLURM writes "64(x2)" or "64,32"; its first count
            lines.append(f"CPUS_{i}=${{SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{i}:-{n}}}; CPUS_{i}=${{CPUS_{i}%%[(,]*}}")
            cpus = f"--cpus-per-task=$(( CPUS_{i} / {n} > 0 ? CPUS_{i} / {n} : 1 ))"
        group = [f"--het-group={i}"] if cluster.pools else []
        srun = ["srun", *group, "--kill-on-bad-exit=1", f"--ntasks={p.n_devices}", f"--ntasks-per-node={n}",
                "--distribution=block", cpus, *map(q, srun_args)]
        lines += [f"{' '.join(srun)} bash -c {q('exec ' + inner)} &", 'SRUN_PIDS="$SRUN_PIDS $!"']
    return lines
