"""Plans and runs of experiments/ppo_tiny.py shared by the multi-process run tests."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "experiments/ppo_tiny.py")

# The CPU profiles of the machine the search tests' workloads were tuned on (profiles/cpu/{tiny,small}.json of
# 2026-11-22, frozen here; the small table's collective fits price the tiny plans' transfers too): whether
# migrating or streaming a tail beats running it out depends on the machine's prices, and the shipped tables
# follow the machine of the day.
TUNED_PROFILES = {name: REPO / "tests" / "data" / f"{name}_profile_2026-11-22.json" for name in ("tiny", "small")}


def tuned_profiles(folder: Path, monkeypatch) -> None:
    """$REALLOC_PROFILES = ``folder``, holding the TUNED_PROFILES tables."""
    (folder / "cpu").mkdir(parents=True)
    for name, path in TUNED_PROFILES.items():
        shutil.copy(path, folder / "cpu" / f"{name}.json")
    monkeypatch.setenv("REALLOC_PROFILES", str(folder))

# Actor and critic on disjoint devices for inference, data-parallel actor training across both: the actor
# is reallocated every iteration and data crosses devices.
DISJOINT = {"actor_gen": ("localhost:0", 1), "rew_inf": ("localhost:0", 1), "ref_inf": ("localhost:1", 1),
            "critic_inf": ("localhost:1", 1), "actor_train": ("localhost", 2), "critic_train": ("localhost:1", 1)}


def disjoint_plan() -> ExecutionPlan:
    spec = load_experiment(TINY)
    g = build_graph(spec)
    return ExecutionPlan.by_hand(g, {c: (m, dp, 1, 1, 1) for c, (m, dp) in DISJOINT.items()}, source="hand")


def hash_seeded_cli(seeds: tuple[int, ...]) -> list[str]:
    """The argv prefix of a `realloc` command whose local worker of rank r runs under PYTHONHASHSEED=seeds[r]: a
    save/restore test's workers then order sets and string-keyed hashes differently (as on different machines)."""
    code = """
import itertools, subprocess, sys, types
from realloc.runtime.launch import launcher

ranks = itertools.count()  # the launcher starts the workers in rank order (they read their arguments later)

def popen(argv, env=None, **kw):
    rank = int(argv[argv.index("--rank") + 1]) if "--rank" in argv else next(ranks)
    return subprocess.Popen(argv, env={**env, "PYTHONHASHSEED": str(%r[rank])}, **kw)

launcher.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})
from realloc.cli import main
sys.exit(main(sys.argv[1:]))
""" % (tuple(seeds),)
    return [sys.executable, "-c", code]
