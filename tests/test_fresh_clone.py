"""Every shipped experiment passes ``realloc show`` on a fresh clone (issue 22 item 18): with the files git
tracks and nothing built, no ``make demo`` or ``arith_demo init`` first."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from realloc.cli import main

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.name for p in (REPO / "experiments").glob("*.py"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The experiments/ folder as a clone has it: only the files git tracks (committed or staged)."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "-z", "experiments"], cwd=REPO, capture_output=True, check=True)
    root = tmp_path_factory.mktemp("clone")
    for name in tracked.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, root / name)
    return root


def test_every_experiment_is_tracked(clone):
    assert sorted(p.name for p in (clone / "experiments").glob("*.py")) == EXPERIMENTS


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_shipped_experiment_passes_show_on_a_fresh_clone(clone, name, capsys):
    assert main(["show", str(clone / "experiments" / name)]) == 0, capsys.readouterr().err
    assert "candidate" in capsys.readouterr().out
