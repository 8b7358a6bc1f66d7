"""The search space's tail rows priced once per decode step (``tail_cost.phase1_cost``'s cache, which made the
RLHFuse dry run's space building fast again): every price a warm cost model gives, after many candidates and
split points shared its cache, equals the one a fresh cost model computes alone, on one kind of device and on a
cluster of two pools (whose models keep caches of their own)."""

from __future__ import annotations

import dataclasses

import pytest

from realloc.api import load_experiment
from realloc.estimator.chunk_cost import CHUNK_GRID, split_times
from realloc.estimator.cost import CostModel
from realloc.estimator.tail_cost import TAIL_GRID, migration_step, phase1_cost, tail_rows
from realloc.graph.dataflow import build_graph
from realloc.graph.tail import split_thresholds
from realloc.lengths import ResponseLengths as R
from realloc.strategy import ParallelStrategy as S


def _graph(path: str, gen_len: int):
    base = load_experiment(path)
    return build_graph(dataclasses.replace(base, gen_len=gen_len,
                                           response_lengths=R.lognormal(gen_len / 16, gen_len * 0.8)))


def _layouts(cost: CostModel):
    for mesh in cost.cluster.device_meshes():
        for dp in (1, 2, 4):
            if mesh.size % dp == 0 and mesh.size // dp <= mesh.n_devs and mesh.n_nodes == 1:
                s = S(dp, mesh.size // dp, 1)
                if cost.graph.model_config("actor_gen").n_heads % s.tp == 0:
                    yield mesh, s


@pytest.mark.parametrize("path,gen_len", [("experiments/ppo_tiny.py", 128), ("experiments/grpo_h100_l40s.py", 512)])
def test_warm_phase_one_prices_equal_fresh_ones(path, gen_len):
    graph = _graph(path, gen_len)
    warm = CostModel(graph, discover=False)
    n = warm.workload("actor_gen").n_seqs
    thresholds = sorted({th for share in TAIL_GRID for k in (1, *CHUNK_GRID)
                         for th in split_thresholds(n, tail_rows(n, share), k)})
    asked, steps, layouts = [], set(), list(_layouts(warm))
    assert layouts
    for mesh, s in layouts:
        for n_mbs in (1, 2):
            for th in thresholds:
                asked.append(((mesh, s, n_mbs, th), phase1_cost(warm, "actor_gen", mesh, s, n_mbs, th)))
                steps.add(migration_step(warm, "actor_gen", th))
    assert len(steps) < len(thresholds)  # some thresholds cut at one step: the cache has something to share
    for (mesh, s, n_mbs, th), got in asked[::7]:  # a fresh model per price: nothing cached from another
        fresh = CostModel(graph, discover=False)
        assert got == phase1_cost(fresh, "actor_gen", mesh, s, n_mbs, th), (mesh.name, s, n_mbs, th)
    if warm.pool_models:  # one shape in two pools: different devices, different prices, each its own
        by_pool = {}
        for (mesh, s, n_mbs, th), got in asked:
            by_pool.setdefault((mesh.pool, mesh.n_devs, s, n_mbs, th), got)
        pairs = [(v, by_pool.get((1, *k[1:]))) for k, v in by_pool.items() if k[0] == 0]
        assert any(b is not None and a != b for a, b in pairs)


def test_split_times_rise_and_equal_fresh_ones():
    """The split points of a chunked stream come in order, each the phase 1 to its threshold plus the requests
    before it, as a fresh model prices them."""
    graph = _graph("experiments/ppo_tiny.py", 128)
    warm = CostModel(graph, discover=False)
    mesh, s = next(_layouts(warm))
    n = warm.workload("actor_gen").n_seqs
    for k in CHUNK_GRID:
        for share in TAIL_GRID:
            times = split_times(warm, "actor_gen", mesh, s, 1, tail_rows(n, share), k)
            assert list(times) == sorted(times)
            assert times == split_times(CostModel(graph, discover=False), "actor_gen", mesh, s, 1,
                                        tail_rows(n, share), k)
