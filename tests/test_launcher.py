"""SLURM launcher: the generated sbatch script, checked as text, by bash, and by running it with a fake srun."""

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan
from realloc.runtime.launcher import RunPaths, SlurmOptions, slurm_script

REPO = Path(__file__).resolve().parents[1]


def whole_cluster_plan(target, dp, tp, n_mbs=1):
    spec = load_experiment(target)
    g = build_graph(spec)
    return ExecutionPlan(experiment=spec.name, graph_digest=g.digest, nodelist=spec.cluster.nodelist,
                         n_devices_per_node=spec.cluster.n_devices_per_node, device=spec.cluster.device,
                         placements={c: CallPlacement(mesh=spec.cluster.whole.name, dp=dp, tp=tp, pp=1, n_mbs=n_mbs)
                                     for c in g.topo_order})


def realloc_cli(*args, env=None, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "realloc.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def test_gpu_script_asks_for_the_nodelist_and_one_task_per_device(tmp_path):
    spec = load_experiment(str(REPO / "experiments/ppo_7b_7b.py"))
    run = RunPaths(tmp_path / "run")
    script = slurm_script(spec.cluster, spec.source, run, "abc123", ["--plan", "p.json", "--iterations", "5"],
                          SlurmOptions(partition="gpu", account="proj", time_limit="2:00:00"))
    lines = script.splitlines()
    for want in ("#SBATCH --nodelist=trainer[01-02]", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --time=2:00:00", f"#SBATCH --output={run.logs}/slurm-%j.out"):
        assert want in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--ntasks=16" in srun and "--kill-on-bad-exit=1" in srun
    for want in ('"$SLURM_PROCID"', '"$MASTER_HOST:$STORE_PORT"', '"tcp://$MASTER_HOST:$MASTER_PORT"',
                 "--device cuda", "--world-size 16", "realloc.runtime.worker"):
        assert want in srun
    master = next(line for line in lines if "realloc.cli run" in line)
    assert "--launcher external" in master and "--bind 0.0.0.0" in master and master.endswith("&")
    assert f"REALLOC_SECRET_FILE={run.secret}" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


GPU_EXPERIMENT = """
import dataclasses
from realloc.algorithms.ppo_config import ppo_rpcs
from realloc.api import auto

@auto(nodelist="gpu[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=64, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class GpuPPO:
    dataset: str = "{dataset}"

    @property
    def rpcs(self):
        return ppo_rpcs(actor="tiny", critic="tiny-critic", n_minibatches=2)
"""


def test_cli_dry_run_prints_the_script_and_writes_a_private_secret(tmp_path):
    exp = tmp_path / "gpu_ppo.py"
    exp.write_text(GPU_EXPERIMENT.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    plan = whole_cluster_plan(str(exp), dp=4, tp=4)
    plan.save(tmp_path / "plan.json")
    r = realloc_cli("run", str(exp), "--plan", str(tmp_path / "plan.json"),
                    "--iterations", "3", "--launcher", "slurm", "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash") and "#SBATCH --nodelist=gpu[01-02]" in r.stdout
    assert "#SBATCH --gpus-per-node=8" in r.stdout and "--iterations 3" in r.stdout
    secret = (tmp_path / "run" / "secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_text().strip() not in r.stdout  # the secret itself never appears in the script
    assert (tmp_path / "run" / "plan.json").is_file()


def test_dry_run_without_slurm_is_a_one_line_error(tmp_path):
    plan = whole_cluster_plan(str(REPO / "experiments/ppo_tiny.py"), dp=2, tp=1)
    plan.save(tmp_path / "plan.json")
    r = realloc_cli("run", str(REPO / "experiments/ppo_tiny.py"), "--plan", str(tmp_path / "plan.json"),
                    "--iterations", "1", "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--dry-run applies to --launcher slurm" in r.stderr


def free_job_id() -> int:
    """A job id whose derived ports (20000 + id % 20000 and 20000 more) are free on this machine right now."""
    for job in range(os.getpid() % 20000, os.getpid() % 20000 + 200):
        port = 20000 + job % 20000
        try:
            for p in (port, port + 20000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return job
    raise RuntimeError("no free port pair for the fake SLURM job")


FAKE_SRUN = """#!/bin/bash
# Stands in for srun: runs the command once per task on this machine, like SLURM would on the nodes.
n=1; args=()
for a in "$@"; do case "$a" in --ntasks=*) n="${a#--ntasks=}";; --*) ;; *) args+=("$a");; esac; done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "${args[@]}" & done
wait
"""


def test_generated_script_trains_with_a_stand_in_srun(tmp_path):
    """The script's rendezvous (TCPStore + ZMQ ports from the job id) works: run it with bash and a fake srun."""
    plan = whole_cluster_plan(str(REPO / "experiments/ppo_tiny.py"), dp=2, tp=1)
    plan.save(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    r = realloc_cli("run", str(REPO / "experiments/ppo_tiny.py"), "--plan", str(tmp_path / "plan.json"),
                    "--iterations", "2", "--launcher", "slurm", "--dry-run", "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stderr
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(FAKE_SRUN)
    (bindir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": str(free_job_id()),
           "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    job = subprocess.run(["bash", "-c", r.stdout], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1] and 0.0 <= metrics[0]["reward"] <= 1.0


def test_local_launcher_refuses_a_gpu_cluster_it_cannot_host(tmp_path):
    exp = tmp_path / "gpu_ppo.py"
    exp.write_text(GPU_EXPERIMENT.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    whole_cluster_plan(str(exp), dp=4, tp=4).save(tmp_path / "plan.json")
    r = realloc_cli("run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "1",
                    "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "spans 2 nodes" in r.stderr and "--launcher slurm" in r.stderr
