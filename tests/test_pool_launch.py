"""Pools under every launcher (issue 32, docs/heterogeneous.md "Running on pools"): the SLURM script of a cluster
of pools (one heterogeneous-job component and one worker step per pool, ranks pool by pool), Ray's bundles (one
per plan node, its pool's size and kind), the local launcher's GPUs, and a run of ``cpu`` + ``cpu-bf16`` pools
under a stand-in SLURM and under a local Ray instance that equals the local launcher's run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_launcher import GPU_EXPERIMENT, fake_slurm_bin, free_job_id, realloc_cli

from realloc.api import load_experiment
from realloc.cluster import ClusterSpec, Pool
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.runtime.control.master_link import plan_node_hosts
from realloc.runtime.launch.launcher import SlurmOptions, slurm_script
from realloc.runtime.launch.pool_launch import check_pools, node_blocks, ray_bundles
from realloc.runtime.records.run_paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
FLEX = str(REPO / "experiments/ppo_33b_a100_v100.py")  # pool 0: a100-01 (8 A100); pool 1: v100-[01-02] (2 x 4 V100)
TWO_KINDS = str(REPO / "experiments/ppo_tiny_two_kinds.py")  # pool 0: cpu0 (cpu, fp32); pool 1: cpu1 (cpu-bf16)
SPLIT = {"actor_gen": "cpu0", "rew_inf": "cpu0", "ref_inf": "cpu1", "critic_inf": "cpu1", "actor_train": "cpu0",
         "critic_train": "cpu0"}  # as tests/test_pool_runs.py: the critic reallocated into bf16 and back
HEADLINE = ("reward", "kl", "actor_loss", "critic_loss", "approx_kl", "actor_grad_norm", "critic_grad_norm",
            "value_mean", "return_mean")

# test_launcher's GPU experiment on two pools of two GPU kinds
GPU_POOLS = GPU_EXPERIMENT.replace('nodelist="gpu[01-02]", n_devices_per_node=8, device="a100-80g"',
                                   'pools=[Pool("a100-01", "a100-80g", 2), Pool("v100-01", "v100-32g", 2)]'
                                   ).replace("import auto", "import Pool, auto")


def _sbatch(script: str) -> list[list[str]]:
    """The #SBATCH lines of each heterogeneous-job component."""
    comps: list[list[str]] = [[]]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            comps.append([])
        elif line.startswith("#SBATCH"):
            comps[-1].append(line)
    return comps


def test_slurm_script_of_pools_is_a_heterogeneous_job_with_ranks_pool_by_pool(tmp_path):
    spec = load_experiment(FLEX)
    opts = SlurmOptions(partition=("a100", "v100"), gres=("gpu:a100", "gpu:v100"), account="proj", python="python3")
    script = slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", ["--iterations", "2"], opts)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    a100, v100 = _sbatch(script)
    for want in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:a100:8",
                 "#SBATCH --partition=a100", "#SBATCH --account=proj", "#SBATCH --time=24:00:00"):
        assert want in a100, want
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gres=gpu:v100:4",
                 "#SBATCH --partition=v100", "#SBATCH --account=proj", "#SBATCH --time=24:00:00"):
        assert want in v100, want
    steps = [x for x in script.splitlines() if x.startswith("srun --het-group") and "control.worker" in x]
    assert len(steps) == 2
    assert "--het-group=0" in steps[0] and "--ntasks=8 --ntasks-per-node=8" in steps[0]
    assert '--rank "$(( 0 + SLURM_PROCID ))"' in steps[0] and "--world-size 16" in steps[0]
    assert "--het-group=1" in steps[1] and "--ntasks=8 --ntasks-per-node=4" in steps[1]
    assert '--rank "$(( 8 + SLURM_PROCID ))"' in steps[1] and "--device cuda" in steps[1]
    assert "PLAN_NODES=(a100-01 v100-01 v100-02)" in script
    assert '"$SLURM_JOB_NODELIST_HET_GROUP_1"' in script
    # One value is every pool's; the wrong count is one error naming the option.
    one = _sbatch(slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", [], SlurmOptions(partition="gpu")))
    assert all("#SBATCH --partition=gpu" in c for c in one) and [[x for x in c if "gpus" in x] for c in one] == [
        ["#SBATCH --gpus-per-node=8"], ["#SBATCH --gpus-per-node=4"]]
    with pytest.raises(ValueError, match="--partition is given 3 times, but cluster .* has 2 pool"):
        slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", [], SlurmOptions(partition=("a", "b", "c")))
    with pytest.raises(ValueError, match="asks for 8 GPUs per node, but the cluster's nodes run 4"):
        slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", [], SlurmOptions(gres=("gpu:8", "gpu:8")))


def test_ray_bundles_and_local_devices_follow_each_pools_nodes():
    flex = load_experiment(FLEX).cluster
    assert ray_bundles(flex) == [{"CPU": 8.0, "GPU": 8.0, "accelerator_type:A100": 0.001},
                                 {"CPU": 4.0, "GPU": 4.0, "accelerator_type:V100": 0.001},
                                 {"CPU": 4.0, "GPU": 4.0, "accelerator_type:V100": 0.001}]
    # rank -> bundle (plan node) and -> GPU inside the node, by hand: 8 A100 ranks, then 2 nodes of 4 V100 ranks
    assert [flex.node_of(r) for r in range(16)] == [0] * 8 + [1] * 4 + [2] * 4
    assert [flex.local_device(r) for r in range(16)] == list(range(8)) + list(range(4)) * 2
    assert [(b.pool, b.first_rank, b.n_devices) for b in node_blocks(flex)] == [(0, 0, 8), (1, 8, 4), (1, 12, 4)]
    cpus = load_experiment(TWO_KINDS).cluster
    assert ray_bundles(cpus) == [{"CPU": 1.0}, {"CPU": 1.0}]  # no GPU, no label
    one_kind = ClusterSpec.from_nodelist("a100-[01-02]", 8, "a100-80g")
    assert ray_bundles(one_kind) == [{"CPU": 8.0, "GPU": 8.0}] * 2  # one kind: no label, as before pools
    # GPU pools under the local launcher all run on this machine (its GPU r for rank r)
    with pytest.raises(ValueError, match="each node of the plan needs a machine of its own"):
        plan_node_hosts(flex, {r: "here" for r in range(16)})
    assert plan_node_hosts(flex, {r: "here" for r in range(16)}, one_machine=True) == ["here"] * 3


def test_cpu_pools_beside_gpu_pools_are_one_clear_error(tmp_path):
    mixed = ClusterSpec.from_pools([Pool("a100-01", "a100-80g", 8), Pool("cpu0", "cpu", 1)])
    with pytest.raises(ValueError, match=r"mixes CPU and GPU pools \(pool 0 \(a100-80g, GPU\), pool 1 \(cpu, CPU\)\)"):
        check_pools(mixed)
    check_pools(load_experiment(FLEX).cluster)  # GPU pools of two kinds: fine
    # The CLI: the GPU pools' script with a partition per pool; the local launcher says what it lacks, in one line.
    exp = tmp_path / "gpu_pools.py"
    exp.write_text(GPU_POOLS.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    graph = build_graph(load_experiment(str(exp)))
    placement = {c: ("v100-01" if c in ("ref_inf", "rew_inf") else "a100-01", 1, 2, 1, 1) for c in graph.topo_order}
    ExecutionPlan.by_hand(graph, placement).save(tmp_path / "plan.json")
    args = ["run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "1", "--run-dir",
            str(tmp_path / "run")]
    r = realloc_cli(*args, "--launcher", "slurm", "--dry-run", "--partition", "a100", "--partition", "v100")
    assert r.returncode == 0, r.stderr
    assert [c[-1] for c in _sbatch(r.stdout)] == ["#SBATCH --partition=a100", "#SBATCH --partition=v100"]
    local = realloc_cli(*args)
    if local.returncode != 0:  # a machine with 4 GPUs would run it
        assert local.returncode == 2 and "Traceback" not in local.stderr
        assert "has 2 pools of 4 GPUs in all, but this machine has" in local.stderr


# -- a real run of two pools under each launcher ------------------------------------------------------------
def _run(base: Path, name: str, *extra: str, tmp: Path | None = None) -> list[dict]:
    r = realloc_cli("run", TWO_KINDS, "--plan", str(base / "plan.json"), "--iterations", "1", "--run-dir",
                    str(base / name), "--quiet", "--no-tensorboard", "--no-final-checkpoint", *extra,
                    env={**os.environ, "TMPDIR": str(tmp or base), "PYTHONPATH": str(REPO)}, timeout=600)
    assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(x) for x in (base / name / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def two_kinds(tmp_path_factory):
    """The plan and the local launcher's run, the reference of the other launchers."""
    base = tmp_path_factory.mktemp("pools")
    graph = build_graph(load_experiment(TWO_KINDS))
    ExecutionPlan.by_hand(graph, {c: (m, 1, 1, 1, 1) for c, m in SPLIT.items()}, source="hand").save(base / "plan.json")
    return base, _run(base, "local")


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == 1
    for k in HEADLINE:
        assert a[0][k] == b[0][k], k


def test_two_kinds_under_a_stand_in_slurm_equal_the_local_run(two_kinds, tmp_path):
    base, local = two_kinds
    run_dir = tmp_path / "run"
    r = realloc_cli("run", TWO_KINDS, "--plan", str(base / "plan.json"), "--iterations", "1", "--launcher", "slurm",
                    "--prepare", "--run-dir", str(run_dir), "--no-tensorboard", "--no-final-checkpoint")
    assert r.returncode == 0, r.stderr
    bindir = fake_slurm_bin(tmp_path)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": str(free_job_id()),
           "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n2", "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    job = subprocess.run(["bash", str(run_dir / "job.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert job.returncode == 0, job.stdout + job.stderr + f" ({time.monotonic() - t0:.0f} s)"
    assert "plan node 1 (cpu1) ->" in job.stdout
    # one step per pool, each task its pool's rank (pool 1's task 0 is rank 1): both ranks said hello
    assert sorted(json.loads((run_dir / "workers.json").read_text())["workers"]) == ["0", "1"]
    _same(local, [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()])


def test_two_kinds_on_ray_equal_the_local_run(two_kinds, tmp_path):
    pytest.importorskip("ray")
    base, local = two_kinds
    (tmp_path / "plan.json").write_bytes((base / "plan.json").read_bytes())
    short = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    try:
        _same(local, _run(tmp_path, "ray", "--launcher", "ray", tmp=short))  # a private Ray instance on loopback
    finally:
        shutil.rmtree(short, ignore_errors=True)
