"""``--launcher ray`` (issue 14, item 6): ppo_tiny on a local Ray instance that this module starts on
loopback gives the same metrics as the local launcher with the same plan and seed, and its workers
really are Ray actors of that instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from run_helpers import REPO, TINY, disjoint_plan

ray = pytest.importorskip("ray")  # an optional extra for installs; the test environment has it

ITERATIONS = 2
HEADLINE = ("reward", "kl", "actor_loss", "critic_loss", "approx_kl", "actor_grad_norm", "critic_grad_norm",
            "value_mean", "return_mean")


@pytest.fixture(scope="module")
def ray_instance(tmp_path_factory):
    """One Ray instance for the module (start-up costs ~10 s on 2 cores), bound to 127.0.0.1."""
    if ray.is_initialized():
        ray.shutdown()
    old = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's switch for a loopback-only node
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # read at import, which may have happened already
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(tmp))
    ctx = ray.get_runtime_context()
    try:
        assert ctx.gcs_address.startswith("127.0.0.1:")
        yield ctx.gcs_address, ctx.get_node_id()
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old


def realloc_run(run_dir, plan, *extra):
    cmd = [sys.executable, "-m", "realloc.cli", "run", TINY, "--plan", str(plan), "--iterations", str(ITERATIONS),
           "--run-dir", str(run_dir), "--quiet", "--no-tensorboard", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(run_dir.parent), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ray_run_matches_the_local_launcher(ray_instance, tmp_path):
    address, node_id = ray_instance
    disjoint_plan().save(tmp_path / "plan.json")
    on_ray = realloc_run(tmp_path / "ray", tmp_path / "plan.json", "--launcher", "ray", "--ray-address", address)
    local = realloc_run(tmp_path / "local", tmp_path / "plan.json")
    assert [m["iteration"] for m in on_ray] == [m["iteration"] for m in local] == [1, 2]
    for a, b in zip(local, on_ray):
        for k in HEADLINE:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (a["iteration"], k)
    assert local[-1]["kl"] > 0  # the policy moved: not a degenerate comparison
    # The workers were actors of this module's Ray instance, and wrote their logs into the run directory.
    for rank in (0, 1):
        log = (tmp_path / "ray" / "logs" / f"worker{rank}.log").read_text()
        assert f"on node {node_id}" in log and "iteration 2 call actor_train" in log


PRIVATE = """
import sys
from pathlib import Path
import ray  # imported before the launcher sets Ray's loopback-only switch: it must hold anyway
from realloc.api import load_experiment
from realloc.runtime.launch.ray_launcher import RayLauncher
from realloc.runtime.records.run_paths import RunPaths

launcher = RayLauncher(load_experiment(sys.argv[1]).cluster, RunPaths(Path(sys.argv[2])))
print(launcher.node_ip, ray.get_runtime_context().gcs_address, ray.cluster_resources().get("CPU"))
launcher.close()
print(ray.is_initialized())
"""


def test_without_an_address_a_private_loopback_instance_is_started_and_shut_down(tmp_path):
    """No --ray-address and no $RAY_ADDRESS: the launcher starts a Ray instance of its own, with the cluster's
    device count in CPUs, on 127.0.0.1 (where the master then binds) even when ray was imported first, and
    ends it on close."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    r = subprocess.run([sys.executable, "-c", PRIVATE, TINY, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    (node_ip, gcs, cpus), (after,) = (line.split() for line in r.stdout.strip().splitlines()[-2:])
    assert node_ip == "127.0.0.1" and gcs.startswith("127.0.0.1:") and float(cpus) == 2.0
    assert after == "False"
