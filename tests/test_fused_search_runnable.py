"""`realloc run` searches only plans its runtime can carry out: no fused train pairs where they cannot run
(NCCL so far, runtime/control/master_fused.py); `realloc search` still shows them, with a note."""

import argparse

import realloc.search as search_pkg
from realloc.api import load_experiment
from realloc.runtime import run_cli
from realloc.search.planner import fused_pairs_run_on, plan_search


def test_fused_pairs_run_on_cpu_clusters_only():
    assert fused_pairs_run_on(load_experiment("experiments/ppo_tiny.py"))
    assert not fused_pairs_run_on(load_experiment("experiments/ppo_70b_7b.py"))


def test_a_search_without_fusion_fuses_nothing():
    spec = load_experiment("experiments/ppo_70b_7b.py")
    report = plan_search(spec, None, max_evals=20_000, n_threads=1, fuse=False)
    assert report.plan.fused == () and report.unfused is None


def test_run_asks_the_search_for_a_plan_it_can_run(monkeypatch):
    seen = {}

    def fake_search(spec, time_limit, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(search_pkg, "search", fake_search)
    args = argparse.Namespace(plan=None, baseline=None, search_time=1.0)
    for path, fuse in (("experiments/ppo_70b_7b.py", False), ("experiments/ppo_tiny.py", True)):
        try:
            run_cli._choose_plan(args, load_experiment(path), None)
        except RuntimeError:
            pass
        assert seen["fuse"] is fuse, path
