"""A built wheel carries what an installed realloc needs (issue 14, item 8): the C++ extension, the hardware
specs and the shipped profiles; and ``realloc search`` works from it, outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

GPU_EXPERIMENT = """
import dataclasses
from realloc.algorithms.ppo.ppo_config import ppo_rpcs
from realloc.api import auto

@auto(nodelist="gpu[01-02]", n_devices_per_node=8, device="h100-80g", batch_size=256, prompt_len=512, gen_len=512)
@dataclasses.dataclass
class GpuPPO:
    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama3-8b", critic="llama3-8b-critic", n_minibatches=4)
"""


def test_wheel_ships_profiles_and_search_runs_from_an_install(tmp_path):
    """The wheel is built from the sdist (as pip does from PyPI), so a file missing from it (the C++ headers)
    fails the build here."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "DEVELOPERS.md", "requirements.txt",
                 "Makefile"):
        shutil.copy(REPO / name, src / name)
    for folder in ("csrc", "realloc", "profiles", "experiments", "docs"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns(
            "__pycache__", "*.so", "*.pyc", "*.egg-info", "hf_tiny", "arith"))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")], cwd=src, check=True,
                   capture_output=True, env=env, timeout=300)
    sdist = next((tmp_path / "sdist").glob("realloc-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    for want in ("csrc/problem.h", "csrc/simulator.h", "csrc/mcmc.h", "csrc/bindings.cpp", "MANIFEST.in",
                 "profiles/hardware/h100-80g.json", "experiments/ppo_tiny.py",
                 "experiments/data/ppo_tiny_prompts.jsonl", "experiments/data/tiny_corpus.txt", "README.md",
                 "docs/README.md", "docs/performance.md"):
        assert want in members, want
    assert {f"csrc/{p.name}" for p in (REPO / "csrc").iterdir() if p.suffix in (".h", ".cpp")} <= members
    assert not any(m.endswith(".so") or "__pycache__" in m for m in members)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(sdist)], check=True, capture_output=True, env=env, timeout=300)
    wheel = next((tmp_path / "dist").glob("realloc-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"realloc/profiles/{p.relative_to(REPO / 'profiles')}" for p in (REPO / "profiles").rglob("*.json")}
    assert {"realloc/profiles/hardware/a100-80g.json", "realloc/profiles/hardware/h100-80g.json",
            "realloc/profiles/cpu/tiny.json"} <= shipped
    assert shipped <= names, sorted(shipped - names)
    assert any(n.startswith("realloc/_C.") and n.endswith(".so") for n in names)

    # Installed (not editable) into a folder of its own and run from elsewhere: the package's own files only.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, env=env, timeout=300)
    exp = tmp_path / "work" / "gpu_ppo.py"
    exp.parent.mkdir()
    exp.write_text(GPU_EXPERIMENT)
    run_env = {**env, "PYTHONPATH": str(site)}
    run_env.pop("REALLOC_PROFILES", None)
    where = subprocess.run([sys.executable, "-c", "import realloc; print(realloc.__file__)"], capture_output=True,
                           text=True, env=run_env, cwd=exp.parent, check=True).stdout
    assert where.startswith(str(site)), where
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "search", str(exp), "--evals", "3000", "--threads", "1"],
                       capture_output=True, text=True, env=run_env, cwd=exp.parent, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "h100-80g" in r.stdout and "searched plan" in r.stdout and "actor_train" in r.stdout
    # The demo needs the source tree's experiments/ (issue 22 item 17): from the install it says so in one line.
    demo = subprocess.run([sys.executable, "-m", "realloc.demo.arith_demo"], capture_output=True, text=True,
                          env=run_env, cwd=exp.parent, timeout=300)
    assert demo.returncode == 2 and "Traceback" not in demo.stderr, demo.stderr
    assert demo.stderr.count("\n") == 1 and "runs from a source checkout" in demo.stderr, demo.stderr
    version = subprocess.run([sys.executable, "-m", "realloc.cli", "--version"], capture_output=True, text=True,
                             env=run_env, cwd=exp.parent, timeout=300)
    assert version.stdout.strip() == "realloc 0.1.0", version  # the installed distribution's, not the source's
