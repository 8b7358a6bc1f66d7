"""The C++ MCMC against brute-force enumeration, and its determinism."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from realloc.algorithms.ppo.ppo_config import ppo_rpcs
from realloc.api import auto, experiment_spec
from realloc.graph.dataflow import build_graph
from realloc.search.build import PlanSpace
from realloc.search.engine import run_mcmc

MiB = 2**20


def ppo_on_4_devices(device_memory: int | None = None):
    """PPO with tiny models on one node of 4 CPU devices."""
    extra = {} if device_memory is None else {"device_memory": device_memory}

    @auto(nodelist="localhost", n_devices_per_node=4, device="cpu", batch_size=64, prompt_len=32, gen_len=32, **extra)
    @dataclasses.dataclass
    class PPO4:
        @property
        def rpcs(self):
            return ppo_rpcs(actor="tiny", critic="tiny-critic", n_minibatches=2)

    return build_graph(experiment_spec(PPO4))


def restricted(space: PlanSpace) -> PlanSpace:
    """Per call: pp=1, the fewest micro-batches of each layout, meshes of 2 or 4 devices, no offload
    (7 candidates; 14 for the train steps, with and without recomputation)."""
    keep = []
    for opts in space.options:
        rows, seen = [], set()
        for i in sorted(range(len(opts)), key=lambda i: (opts[i].n_mbs, opts[i].offload)):
            mesh, s, m, rc, offload = opts[i]
            if s.pp == 1 and mesh.size >= 2 and not offload and (mesh.name, s, rc) not in seen:
                seen.add((mesh.name, s, rc))
                rows.append(i)
        keep.append(sorted(rows))
    return space.restrict(keep)


def brute_force(space: PlanSpace) -> tuple[np.ndarray, dict]:
    space.price_all_pairs()
    plans = np.array(list(itertools.product(*[range(n) for n in space.n_candidates])), np.int32)
    res = space.cpp.evaluate_batch(plans)
    feasible = res["feasible"]
    best = int(np.argmin(np.where(feasible, res["cost"], np.inf)))
    return plans[best], {"n_plans": len(plans), "n_feasible": int(feasible.sum()), "cost": res["cost"][best]}


def _recomputes(space: PlanSpace, plans: np.ndarray) -> np.ndarray:
    out = np.zeros(len(plans), bool)
    for c, opts in enumerate(space.options):
        out |= np.array([o.recompute for o in opts])[plans[:, c]]
    return out


@pytest.fixture(scope="module")
def memory_limits() -> dict[str, int]:
    """Device memories under which the exhaustive optimum is decided by the memory check."""
    space = restricted(PlanSpace.build(ppo_on_4_devices(), prune_memory=False))
    plans = np.array(list(itertools.product(*[range(n) for n in space.n_candidates])), np.int32)
    space.price_all_pairs()
    res = space.cpp.evaluate_batch(plans)
    order = np.argsort(res["cost"], kind="stable")
    peak = res["peak_memory"][order]
    # The fastest plans that fit within a limit are the prefix minima of the peaks in cost order. Limits where
    # less than 90% of the plans fit, so that the memory check decides the answer: just below the peak of the
    # unconstrained optimum (or of the first optimum under a limit whose peak leaves that few), and the largest
    # memory whose optimum (the cheapest plan that fits) recomputes activations.
    firsts = np.r_[0, np.nonzero(np.diff(np.minimum.accumulate(peak)) < 0)[0] + 1]
    below = next(int(peak[i]) - 1 for i in firsts if np.mean(res["peak_memory"] < peak[i]) < 0.9)
    recompute = int(peak[next(i for i in firsts if _recomputes(space, plans[order[i]][None])[0]
                              and np.mean(res["peak_memory"] <= peak[i]) < 0.9)])
    out = {"below the unconstrained optimum": below, "the optimum recomputes": recompute}
    for limit in out.values():
        assert 0.05 < np.mean(res["peak_memory"] <= limit) < 0.95
    return out


@pytest.mark.parametrize("case", ["below the unconstrained optimum", "the optimum recomputes"])
def test_mcmc_finds_the_exhaustive_optimum_on_1x4(memory_limits, case):
    graph = ppo_on_4_devices(memory_limits[case])
    reference = restricted(PlanSpace.build(graph, prune_memory=False))
    best, info = brute_force(reference)
    assert info["n_plans"] > 100_000 and 0.05 * info["n_plans"] < info["n_feasible"] < 0.9 * info["n_plans"]
    assert _recomputes(reference, best[None])[0] == (case == "the optimum recomputes")
    for seed in range(3):
        # A fresh space: every transfer cost is priced lazily during the search.
        space = restricted(PlanSpace.build(graph, prune_memory=False))
        out = run_mcmc(space, time_limit=None, max_evals=60_000, seed=seed, n_chains=2, n_threads=1)
        assert out.evaluation["feasible"]
        assert out.evaluation["cost"] == pytest.approx(info["cost"], rel=1e-12), (seed, out.indices, best)
        # the search visited a tiny part of the pair space but priced what the optimum needs
        assert out.stats.evals <= 60_000


def test_same_seed_same_result_and_history():
    graph = ppo_on_4_devices()

    def once(threads: int):
        space = PlanSpace.build(graph)
        return run_mcmc(space, time_limit=None, max_evals=40_000, seed=7, n_chains=2, n_threads=threads)

    a, b, c = once(1), once(1), once(2)
    assert np.array_equal(a.indices, b.indices)
    assert [h[1:] for h in a.stats.history] == [h[1:] for h in b.stats.history]
    # threads only change which thread runs which chain
    assert np.array_equal(a.indices, c.indices) and a.evaluation == c.evaluation


def test_early_rejection_takes_the_same_steps_with_fewer_simulations():
    # on GPUs: CPU devices share cores, a schedule the bounded simulation does not cut short
    @auto(nodelist="gpu[1-2]", n_devices_per_node=4, device="a100-80g", batch_size=64, prompt_len=32, gen_len=32)
    @dataclasses.dataclass
    class PPOGpu:
        @property
        def rpcs(self):
            return ppo_rpcs(actor="tiny", critic="tiny-critic", n_minibatches=2)

    graph = build_graph(experiment_spec(PPOGpu))

    def once(early: bool):
        space = PlanSpace.build(graph)
        return run_mcmc(space, time_limit=None, max_evals=30_000, seed=3, n_chains=2, n_threads=1,
                        early_reject=early)

    full, early = once(False), once(True)
    assert np.array_equal(full.indices, early.indices) and full.evaluation == early.evaluation
    assert [h[1:] for h in full.stats.history] == [h[1:] for h in early.stats.history]
    assert full.stats.evals == early.stats.evals == full.stats.simulations
    assert early.stats.simulations < 0.8 * early.stats.evals


def test_budget_stops_the_search_and_result_beats_the_greedy_start():
    space = PlanSpace.build(ppo_on_4_devices())
    out = run_mcmc(space, time_limit=None, max_evals=12_000, seed=1, n_chains=2, n_threads=2, n_temps=3)
    assert out.stats.evals == 12_000
    assert out.evaluation["exact"]
    start = space.cpp.evaluate(out.start)
    assert out.evaluation["cost"] <= start["cost"]
    # the history is monotone and ends at the returned plan
    costs = [h[2] for h in out.stats.history]
    assert costs == sorted(costs, reverse=True) or all(not h[4] for h in out.stats.history[:1])
    assert out.stats.history[-1][2] == pytest.approx(out.evaluation["cost"])
