"""SLURM launcher: the generated sbatch script, checked as text, by bash, and by running it with a fake srun."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan
from realloc.runtime.control.master_link import plan_node_hosts
from realloc.runtime.launch.launcher import SlurmOptions, slurm_ports, slurm_script
from realloc.runtime.records.run_paths import RunPaths

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


def test_gpu_script_has_the_options_and_one_task_per_device(tmp_path):
    spec = load_experiment(str(REPO / "experiments/ppo_7b_7b.py"))
    run = RunPaths(tmp_path / "run")
    script = slurm_script(spec.cluster, spec.source, run, "abc123", ["--plan", "p.json", "--iterations", "5"],
                          SlurmOptions(partition="gpu", account="proj", time_limit="2:00:00",
                                       extra_sbatch=("qos=high", "--mem=0"), setup=("module load cuda/12.4",
                                                                                    "source ~/venv/bin/activate"),
                                       srun_args=("container-image=nvcr.io/realloc:1",), cpus_per_task=12),
                          overrides=("ppo.lr=1e-6",))
    lines = script.splitlines()
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=2:00:00",
                 "#SBATCH --qos=high", "#SBATCH --mem=0", "#SBATCH --cpus-per-task=12",
                 f"#SBATCH --output={run.logs}/slurm-%j.out", "module load cuda/12.4", "source ~/venv/bin/activate"):
        assert want in lines, want
    # Plans name node indices: no host is pinned unless asked, and node i maps onto the i-th allocated node.
    assert not any(line.startswith("#SBATCH --nodelist") for line in lines)
    assert "PLAN_NODES=(trainer01 trainer02)" in lines
    assert any("scontrol show hostnames" in line for line in lines)
    # The setup lines run before anything starts.
    assert lines.index("module load cuda/12.4") < next(i for i, x in enumerate(lines) if "realloc.cli run" in x)
    srun = next(line for line in lines if line.startswith("srun --kill-on-bad-exit"))
    assert "--ntasks=16" in srun and "--kill-on-bad-exit=1" in srun and "--distribution=block" in srun
    assert "--container-image=nvcr.io/realloc:1" in srun and "--cpus-per-task=12" in srun
    for want in ('"$SLURM_PROCID"', '"$MASTER_HOST:$STORE_PORT"', '"tcp://$MASTER_HOST:$MASTER_PORT"',
                 "--device cuda", "--world-size 16", "realloc.runtime.control.worker", "--set ppo.lr=1e-6"):
        assert want in srun, want
    master = next(line for line in lines if "realloc.cli run" in line)
    assert "--launcher external" in master and "--bind 0.0.0.0" in master and master.endswith("&")
    # The master is a step in the workers' environment (the container), one task on the batch node.
    assert master.startswith('srun --nodes=1 --ntasks=1 --overlap --nodelist="${JOB_NODES[0]}" ')
    assert master.index("--container-image=nvcr.io/realloc:1") < master.index("realloc.cli run")
    assert f"REALLOC_SECRET_FILE={run.secret}" in script
    assert not any("REALLOC_PROFILES" in line for line in lines)  # only when asked
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_default_cpus_split_the_node_and_a_nodelist_can_be_pinned(tmp_path):
    spec = load_experiment(str(REPO / "experiments/ppo_7b_7b.py"))
    script = slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", [],
                          SlurmOptions(nodelist="gpu[07-08]"))
    assert "#SBATCH --exclusive" in script.splitlines() and "#SBATCH --nodelist=gpu[07-08]" in script.splitlines()
    srun = next(line for line in script.splitlines() if line.startswith("srun --kill-on-bad-exit"))
    # 64 CPUs on a node of 8 GPUs: 8 per worker, computed by the job from the node it got.
    cpus = srun.split("--cpus-per-task=")[1].split(" bash")[0]
    out = subprocess.run(["bash", "-c", f"SLURM_CPUS_ON_NODE=64; echo {cpus}"], capture_output=True, text=True)
    assert out.stdout.strip() == "8"


def test_ports_stay_below_the_ephemeral_range():
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    seen = set()
    for job in (0, 1, 5999, 6000, 12345, 2**31 - 1):
        store, master = slurm_ports(job)
        assert 1024 <= store < master < lo and master == store + 1
        seen.add(store)
    assert len(seen) > 3
    # The script computes the same ports as slurm_ports.
    spec = load_experiment(str(REPO / "experiments/ppo_tiny.py"))
    script = slurm_script(spec.cluster, spec.source, RunPaths(Path("/tmp/x")), "x", [])
    ports = "\n".join(x for x in script.splitlines() if x.startswith("export STORE_PORT") or
                      x.startswith("export MASTER_PORT"))
    out = subprocess.run(["bash", "-c", f"SLURM_JOB_ID=12345\n{ports}\necho $STORE_PORT $MASTER_PORT"],
                         capture_output=True, text=True)
    assert tuple(map(int, out.stdout.split())) == slurm_ports(12345)


GPU_EXPERIMENT = """
import dataclasses
from realloc.algorithms.ppo.ppo_config import ppo_rpcs
from realloc.api import auto

@auto(nodelist="gpu[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=64, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class GpuPPO:
    dataset: str = "{dataset}"

    @property
    def rpcs(self):
        return ppo_rpcs(actor="tiny", critic="tiny-critic", n_minibatches=2)
"""


def test_cli_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    exp = tmp_path / "gpu_ppo.py"
    exp.write_text(GPU_EXPERIMENT.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    plan = whole_cluster_plan(str(exp), dp=4, tp=4)
    plan.save(tmp_path / "plan.json")
    work = tmp_path / "work"
    work.mkdir()
    args = ["run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "3", "--launcher", "slurm",
            "--partition", "a100", "--time", "1:30:00", "--setup", "module load nccl", "--call-timeout", "900"]
    profiles = tmp_path / "my profiles"
    profiles.mkdir()
    r = realloc_cli(*args, "--dry-run", "--profiles", str(profiles), cwd=work)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in r.stdout
    # --profiles reaches the job: exported for the master and workers, and on the master's command line.
    lines = r.stdout.splitlines()
    assert f"export REALLOC_PROFILES='{profiles}'" in lines
    master = next(line for line in lines if "realloc.cli run" in line)
    assert f"--profiles '{profiles}'" in master and "--call-timeout 900.0" in master  # the master watches the calls
    assert "#SBATCH --gpus-per-node=8" in r.stdout and "--iterations 3" in r.stdout
    assert "#SBATCH --partition=a100" in r.stdout and "#SBATCH --time=1:30:00" in r.stdout
    assert list(work.iterdir()) == []  # no runs/, plan or secret
    # --prepare writes the run directory with a private secret, and says how to submit it.
    r = realloc_cli(*args, "--prepare", "--run-dir", str(tmp_path / "run"), cwd=work)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    assert f"sbatch {run / 'job.sbatch'}" in r.stdout
    assert stat.S_IMODE((run / "secret").stat().st_mode) == 0o600
    assert (run / "secret").read_text().strip() not in (run / "job.sbatch").read_text()
    assert (run / "plan.json").is_file() and "#SBATCH --partition=a100" in (run / "job.sbatch").read_text()


def test_slurm_wandb_without_the_package_fails_before_submitting(tmp_path, monkeypatch, capsys):
    """The job would fail only after waiting in the queue: the submitting host's environment, which the job
    inherits, is checked first. With --setup lines (which may activate another environment) the job checks."""
    from realloc.cli import main

    exp = tmp_path / "gpu_ppo.py"
    exp.write_text(GPU_EXPERIMENT.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    whole_cluster_plan(str(exp), dp=4, tp=4).save(tmp_path / "plan.json")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    args = ["run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "3", "--launcher", "slurm",
            "--wandb", "proj", "--dry-run"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["realloc run: error: --wandb needs the wandb package: pip install 'realloc[wandb]'"], err
    assert main([*args, "--setup", "conda activate rl"]) == 0
    script = capsys.readouterr().out
    assert "conda activate rl" in script and "--wandb proj" in script
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_ppo.py", "plan.json"]  # a dry run writes nothing


def test_gpu_experiment_without_prompts_says_how_to_give_them(tmp_path):
    r = realloc_cli("run", str(REPO / "experiments/ppo_7b_7b.py"), "--launcher", "slurm", "--dry-run",
                    "--iterations", "1", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "--set dataset=" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_without_slurm_is_a_one_line_error(tmp_path):
    plan = whole_cluster_plan(str(REPO / "experiments/ppo_tiny.py"), dp=2, tp=1)
    plan.save(tmp_path / "plan.json")
    r = realloc_cli("run", str(REPO / "experiments/ppo_tiny.py"), "--plan", str(tmp_path / "plan.json"),
                    "--iterations", "1", "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--dry-run applies to --launcher slurm" in r.stderr


def free_job_id() -> int:
    """A job id whose derived ports (``slurm_ports``) are free on this machine right now."""
    for job in range(os.getpid() % 6000, os.getpid() % 6000 + 200):
        try:
            for p in slurm_ports(job):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return job
    raise RuntimeError("no free port pair for the fake SLURM job")


FAKE_SRUN = """#!/bin/bash
# Stands in for srun: runs the command once per task on this machine, like SLURM would on the nodes,
# passes signals on to the tasks and exits with the highest task status.
n=1
while [ $# -gt 0 ]; do case "$1" in --ntasks=*) n="${1#--ntasks=}"; shift;; -*) shift;; *) break;; esac; done
pids=()
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!); done
for s in TERM USR1 USR2 INT; do trap "kill -$s ${pids[*]} 2>/dev/null" $s; done
status=0
for p in "${pids[@]}"; do
  while :; do wait $p; rc=$?; kill -0 $p 2>/dev/null || break; done
  [ $rc -gt $status ] && status=$rc
done
exit $status
"""

FAKE_SCONTROL = """#!/bin/bash
# Stands in for `scontrol show hostnames LIST`: this machine is the job's only node (plus $FAKE_EXTRA_NODE).
[ "$1 $2" = "show hostnames" ] && hostname && [ -n "${FAKE_EXTRA_NODE:-}" ] && echo "$FAKE_EXTRA_NODE"
true
"""


def fake_slurm_bin(tmp_path: Path) -> Path:
    """A folder with the stand-in ``srun`` and ``scontrol``, to put first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def test_generated_script_trains_with_a_stand_in_srun_and_stops_on_the_warning_signal(tmp_path):
    """The script's rendezvous (TCPStore + ZMQ ports from the job id) works: run it with bash and a fake srun.
    SLURM's warning signal (USR1, 120 s before the time limit) reaches the script, which passes it to the
    master: it finishes the iterations in flight, saves a checkpoint and exits with 128 + 10."""
    plan = whole_cluster_plan(str(REPO / "experiments/ppo_tiny.py"), dp=2, tp=1)
    plan.save(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    r = realloc_cli("run", str(REPO / "experiments/ppo_tiny.py"), "--plan", str(tmp_path / "plan.json"),
                    "--iterations", "1000", "--launcher", "slurm", "--prepare", "--run-dir", str(run_dir),
                    "--no-tensorboard")
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --signal=B:USR1@120" in (run_dir / "job.sbatch").read_text().splitlines()
    bindir = fake_slurm_bin(tmp_path)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": str(free_job_id()),
           "SLURM_JOB_NODELIST": "n1", "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    # A job that ends before the master starts (SLURM gave two nodes for a one-node plan) removes the secret.
    assert (run_dir / "secret").is_file()
    early = subprocess.run(["bash", str(run_dir / "job.sbatch")], env={**env, "FAKE_EXTRA_NODE": "n2"},
                           capture_output=True, text=True, timeout=60)
    assert early.returncode == 2 and "the plan has 1 nodes but SLURM allocated 2" in early.stderr
    assert not (run_dir / "secret").exists()
    # Run again (as a requeued job would): the script makes a fresh private secret for the master and workers.
    with open(tmp_path / "job.out", "w") as out, open(tmp_path / "job.err", "w") as err:
        job = subprocess.Popen(["bash", str(run_dir / "job.sbatch")], env=env, cwd=tmp_path, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    stdout, stderr = (tmp_path / "job.out").read_text(), (tmp_path / "job.err").read_text()
    assert job.returncode == 128 + signal.SIGUSR1, stdout + stderr
    assert f"plan node 0 (localhost) -> {socket.gethostname()}" in stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    n = len(metrics)
    assert [m["iteration"] for m in metrics] == list(range(1, n + 1)) and 0.0 <= metrics[0]["reward"] <= 1.0
    assert f"stopped by SIGUSR1 after iteration {n}; saved {run_dir / 'checkpoints' / f'iter_{n:08d}'}" in stderr
    # The run secret lives only as long as the job.
    assert not (run_dir / "secret").exists()


def test_local_launcher_refuses_a_gpu_cluster_it_cannot_host(tmp_path):
    exp = tmp_path / "gpu_ppo.py"
    exp.write_text(GPU_EXPERIMENT.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    whole_cluster_plan(str(exp), dp=4, tp=4).save(tmp_path / "plan.json")
    r = realloc_cli("run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "1",
                    "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "spans 2 nodes" in r.stderr and "--launcher slurm" in r.stderr


def test_plan_nodes_map_onto_the_hosts_the_workers_report():
    gpu = load_experiment(str(REPO / "experiments/ppo_7b_7b.py")).cluster  # 2 nodes x 8
    hosts = {r: ("gpu-a" if r < 8 else "gpu-b") for r in range(16)}
    assert plan_node_hosts(gpu, hosts) == ["gpu-a", "gpu-b"]
    cyclic = {r: ("gpu-a" if r % 2 == 0 else "gpu-b") for r in range(16)}  # srun --distribution=cyclic
    with pytest.raises(ValueError, match=r"plan node 0 \(trainer01\) should be one machine.*ranks 0..7"):
        plan_node_hosts(gpu, cyclic)
    with pytest.raises(ValueError, match="each node of the plan needs a machine of its own"):
        plan_node_hosts(gpu, {r: "gpu-a" for r in range(16)})
    cpu = load_experiment(str(REPO / "experiments/ppo_tiny.py")).cluster
    assert plan_node_hosts(cpu, {0: "here", 1: "here"}) == ["here"]  # CPU nodes may share a host


def _master_and_workers_python(script: str) -> tuple[str, str]:
    lines = script.splitlines()
    master = next(line for line in lines if "realloc.cli run" in line)
    workers = next(line for line in lines if line.startswith("srun --kill-on-bad-exit"))
    py_master = master.split(" -m realloc.cli")[0].split()[-1]
    py_worker = workers.split("'exec ")[1].split()[0]
    return py_master, py_worker


@pytest.mark.parametrize("opts, python", [
    (SlurmOptions(), sys.executable),  # the job runs in this environment: this interpreter
    (SlurmOptions(setup=("source /opt/env/bin/activate",)), "python3"),  # another environment: its PATH
    (SlurmOptions(srun_args=("container-image=nvcr.io/realloc:1",)), "python3"),
    (SlurmOptions(srun_args=("--container-image=x",), python="/opt/venv/bin/python"), "/opt/venv/bin/python"),
])
def test_slurm_python_is_the_jobs_own_when_it_has_another_environment(tmp_path, opts, python):
    """Issue 22 item 14: with --setup lines or a container image the job must not run the submit host's
    interpreter by absolute path; --python overrides, and master and workers use the same one."""
    spec = load_experiment(str(REPO / "experiments/ppo_7b_7b.py"))
    script = slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", [], opts)
    assert _master_and_workers_python(script) == (python, python)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_slurm_mem_and_gres(tmp_path):
    spec = load_experiment(str(REPO / "experiments/ppo_7b_7b.py"))  # 2 nodes x 8 GPUs

    def sbatch(**kw) -> list[str]:
        script = slurm_script(spec.cluster, spec.source, RunPaths(tmp_path), "x", [], SlurmOptions(**kw))
        return [x for x in script.splitlines() if x.startswith("#SBATCH")]

    assert "#SBATCH --gpus-per-node=8" in sbatch() and not any("--mem" in x or "--gres" in x for x in sbatch())
    lines = sbatch(mem="200G", gres="gpu:a100")
    assert "#SBATCH --mem=200G" in lines and "#SBATCH --gres=gpu:a100:8" in lines
    assert not any("--gpus-per-node" in x for x in lines)  # one GPU request, not two
    assert "#SBATCH --gres=gpu:8" in sbatch(gres="gpu") and "#SBATCH --gres=gpu:h100:8" in sbatch(gres="gpu:h100:8")
    with pytest.raises(ValueError, match="asks for 4 GPUs per node, but the cluster's nodes run 8"):
        sbatch(gres="gpu:4")
    with pytest.raises(ValueError, match="--mem '2 GB'"):
        SlurmOptions(mem="2 GB")
    tiny = load_experiment(str(REPO / "experiments/ppo_tiny.py"))
    with pytest.raises(ValueError, match="runs on CPUs"):
        slurm_script(tiny.cluster, tiny.source, RunPaths(tmp_path), "x", [], SlurmOptions(gres="gpu"))


def test_cli_slurm_python_mem_and_gres_reach_the_script(tmp_path):
    exp = tmp_path / "gpu_ppo.py"
    exp.write_text(GPU_EXPERIMENT.format(dataset=REPO / "experiments/data/ppo_tiny_prompts.jsonl"))
    plan = whole_cluster_plan(str(exp), dp=4, tp=4)
    plan.save(tmp_path / "plan.json")
    out = realloc_cli("run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "2", "--launcher",
                      "slurm", "--dry-run", "--python", "/opt/py/bin/python3", "--mem", "0", "--gres", "gpu:a100",
                      "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --mem=0" in out.stdout and "#SBATCH --gres=gpu:a100:8" in out.stdout
    assert _master_and_workers_python(out.stdout) == ("/opt/py/bin/python3", "/opt/py/bin/python3")
    bad = realloc_cli("run", str(exp), "--plan", str(tmp_path / "plan.json"), "--iterations", "2", "--launcher",
                      "slurm", "--dry-run", "--gres", "gpu:2", "--run-dir", str(tmp_path / "run"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--gres 'gpu:2'" in bad.stderr
    assert not (tmp_path / "run").exists()
