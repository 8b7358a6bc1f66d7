"""`realloc run` searches only plans its runtime can carry out (search.RunLimits): no fused train pairs under
`--no-fused-pairs` (they run on gloo and NCCL, runtime/control/master_fused.py).
Tails run ahead of training and beside token balancing (tests/test_tail_stale.py, tests/test_tail_balance.py)."""

import argparse
import dataclasses

import pytest

import realloc.search as search_pkg
from realloc.api import load_experiment
from realloc.runtime import run_cli
from realloc.search.planner import RunLimits, plan_search


def _proposals(monkeypatch, limits: RunLimits):
    """The fused pairs each chain's space offers and the chance it proposes fusing one, and the search's report."""
    import realloc.search.planner as planner

    seen = []

    def spy(space, **kwargs):
        seen.append((len(space.problem.fused), kwargs.get("p_fuse")))
        return run_mcmc(space, **kwargs)

    run_mcmc = planner.run_mcmc
    monkeypatch.setattr(planner, "run_mcmc", spy)
    report = plan_search(load_experiment("experiments/ppo_7b_7b.py"), None, max_evals=2_000, n_threads=1,
                         runnable=limits)
    assert seen and all(pairs > 0 for pairs, _ in seen)  # the space offers fused pairs
    return seen, report


def test_a_runnable_search_on_gpus_fuses_unless_told_not_to(monkeypatch):
    seen, _ = _proposals(monkeypatch, RunLimits())  # NCCL runs fused pairs (tests/test_fused_rendezvous.py)
    assert seen[0][1] is None  # the MCMC's own rate of fuse moves (a fused winner's unfused search follows)
    seen, report = _proposals(monkeypatch, RunLimits(fused_pairs=False))  # realloc run --no-fused-pairs
    assert all(p_fuse == 0.0 for _, p_fuse in seen)  # no chain proposes one (test_fused_search.py: p_fuse 0)
    assert report.plan.fused == () and report.unfused is None
    args = argparse.Namespace(plan=None, baseline=None, search_time=1.0, no_fused_pairs=True)
    monkeypatch.setattr(search_pkg, "search", lambda spec, t, runnable: runnable)
    assert run_cli._choose_plan(args, load_experiment("experiments/ppo_70b_7b.py"), None)[0] == \
        RunLimits(fused_pairs=False)


def test_a_runnable_search_offers_tails_ahead_of_training():
    from realloc.lengths import ResponseLengths

    base = load_experiment("experiments/ppo_tiny.py")  # long-tailed as in test_tail_search.py, one step ahead allowed
    spec = dataclasses.replace(base, gen_len=128, response_lengths=ResponseLengths.lognormal(8, 102.4), max_staleness=1)
    free = plan_search(spec, None, max_evals=40_000, n_threads=1)
    ran = plan_search(spec, None, max_evals=40_000, n_threads=1, runnable=RunLimits())
    # the runtime carries out tails at staleness 1 (tests/test_tail_stale.py): run's search keeps them, and finds
    # the unrestricted search's plans
    assert ran.by_staleness[1].tail and ran.by_staleness[1].tail == free.by_staleness[1].tail
    assert ran.plan.estimated_time == free.plan.estimated_time


def test_run_asks_the_search_for_a_plan_it_can_run(monkeypatch):
    seen = {}

    def fake_search(spec, time_limit, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(search_pkg, "search", fake_search)
    args = argparse.Namespace(plan=None, baseline=None, search_time=1.0)
    for path in ("experiments/ppo_70b_7b.py", "experiments/ppo_tiny.py"):
        try:
            run_cli._choose_plan(args, load_experiment(path), None)
        except RuntimeError:
            pass
        assert seen["runnable"] == search_pkg.RunLimits(), path


def test_no_migration_for_a_rollout_generated_turn_by_turn():
    """A multi-turn rollout generates turn by turn: the search offers it no migration and the runtime refuses one."""
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from realloc.graph.streaming import check_runtime_tail
    from realloc.lengths import ResponseLengths
    from realloc.search.tail_space import eligible

    base = load_experiment("experiments/calc_grpo_tool.py")
    graph = build_graph(dataclasses.replace(base, response_lengths=ResponseLengths.lognormal(4, base.gen_len * 0.8)))
    gen = next(c.name for c in graph.calls if c.interface_type.value == "generate")
    assert not eligible(graph, gen)
    plan = ExecutionPlan.by_hand(graph, {c: ("localhost", 2, 1, 1, 1) for c in graph.spec.call_names},
                                 tail={gen: (2, 1)})
    with pytest.raises(ValueError, match="generates turn by turn"):
        check_runtime_tail(plan, graph)
