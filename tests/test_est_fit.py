"""A train call's waits at dp > 1 (issue 31, bench_fusion's ``fit`` setting; docs/estimator.md, "Waits at dp > 1").

Each blocking dp collective of a train step is entered by one rank before the other; ``realloc profile`` measures
such an all-reduce (``all_reduce_late``) and the estimator adds its excess over the back-to-back latency once per
blocking dp collective. Prices are checked against hand-computed sums, the count of collectives against a real
train step at dp 2, tables without the entry price exactly as before, and both plan simulators agree."""

from __future__ import annotations

import math

import numpy as np
import pytest

from realloc.estimator.call_time import GRAD_BUCKET_NUMEL, CallTimer, train_step_dp_syncs
from realloc.estimator.comm import CollectiveFit, CommModel, Link
from realloc.models.param_layout import trained_shard_numel
from realloc.strategy import ParallelStrategy as S

from cost_helpers import tiny_ppo_cost
from mp_pool import GlooPool

AR = CollectiveFit("all_reduce", 2, Link.INTRA, 2e-4, 1e-9)
AG = CollectiveFit("all_gather", 2, Link.INTRA, 1.5e-4, 2e-9)
LATE = CollectiveFit("all_reduce_late", 2, Link.INTRA, 2.2e-3, 0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_ppo_cost()


def _cluster():
    return tiny_ppo_cost().cluster


def _timers(model, fits):
    cfg = model.graph.model_config("actor_train")
    costs = model.layer_costs(cfg)
    comm = CommModel(model.cluster, fits)
    return cfg, CallTimer(cfg, costs, comm, model.hw), comm


def test_each_blocking_dp_collective_of_a_train_call_pays_the_late_all_reduces_excess(model):
    cfg, plain, _ = _timers(model, [AR, AG])
    _, late, comm = _timers(model, [AR, AG, LATE])
    excess = 2.2e-3 - (2e-4 + 8 * 1e-9)  # the late all-reduce less the fitted all-reduce at its 8 bytes
    assert comm.late_extra(2) == pytest.approx(excess, rel=1e-12)
    work = model.workload("actor_train")
    s = S(2, 1, 1)
    links = model.links(model.cluster.whole, s)
    buckets = math.ceil(trained_shard_numel(cfg, 1, 1, 0) / GRAD_BUCKET_NUMEL)
    assert buckets == 1 and work.n_steps >= 1
    # per mini-batch step: its bucket's reduce-scatter and all-gather, the norm's and the statistics' all-reduces;
    # once per call: PPO's advantage moments
    want = (work.n_steps * (2 * buckets + 2) + 1) * excess
    got = late.time(work, s, links, 1).time - plain.time(work, s, links, 1).time
    assert got == pytest.approx(want, rel=1e-9)
    assert late.time(work, s, links, 1).dp_allreduce - plain.time(work, s, links, 1).dp_allreduce == \
        pytest.approx(want, rel=1e-9)
    # dp 1 has no dp collective to wait in, and inference none at all
    one = S(1, 1, 1)
    assert late.time(work, one, links, 1) == plain.time(work, one, links, 1)
    inf = model.workload("ref_inf")
    assert late.time(inf, s, links, 1) == plain.time(inf, s, links, 1)


def test_late_extra_takes_the_nearest_group_size_and_never_goes_negative(model):
    four = CollectiveFit("all_reduce", 4, Link.INTRA, 3e-4, 1e-9)
    comm = CommModel(model.cluster, [AR, four, LATE])
    assert comm.late_extra(4) == pytest.approx(2.2e-3 - (3e-4 + 8e-9))  # the late fit of n 2 for a group of 4
    assert comm.late_extra(1) == 0.0
    fast = CollectiveFit("all_reduce_late", 2, Link.INTRA, 1e-4, 0.0)  # faster than back to back: no excess
    assert CommModel(model.cluster, [AR, fast]).late_extra(2) == 0.0


def test_tables_without_the_late_entry_price_as_before(model):
    """The roofline, and a table's fits without ``all_reduce_late``: no excess, the same train call."""
    assert model.comm.late_extra(2) == 0.0
    _, plain, comm = _timers(model, [AR, AG])
    assert comm.late_extra(2) == 0.0
    _, clipped, _ = _timers(model, [AR, AG, CollectiveFit("all_reduce_late", 2, Link.INTRA, 0.0, 0.0)])
    work, s = model.workload("critic_train"), S(2, 1, 1)
    links = model.links(model.cluster.whole, s)
    assert clipped.time(work, s, links, 1) == plain.time(work, s, links, 1)


def test_a_profile_keeps_the_late_mean_as_measured():
    """``realloc profile``'s table: the late all-reduce's one point is its alpha (no fit through it), and the
    table's JSON round-trips with it."""
    from realloc.estimator.profile_cli import ProfileJob, assemble_table, default_grid, profiled_config
    from realloc.estimator.profile_table import ProfileTable

    cfg = profiled_config("tiny")
    job = ProfileJob(model_type="tiny", device="cpu", kind="cpu", dtype="fp32", tps=(), grid=default_grid(cfg, 1, 1),
                     collective_sizes=(2,), max_collective_bytes=64, collective_repeats=3)
    raw = {"tp": {}, "collectives": [{"op": "all_reduce", "n": 2, "points": [[4, 2e-4], [16, 2.1e-4], [64, 2.2e-4]]},
                                     {"op": "all_reduce_late", "n": 2, "points": [[8, 1.7e-3]]}]}
    table = assemble_table(job, raw, {})
    late = next(c for c in table.collectives if c.op == "all_reduce_late")
    assert (late.alpha, late.beta, late.points) == (1.7e-3, 0.0, [(8.0, 1.7e-3)])
    again = ProfileTable.from_json(table.to_json())
    assert CommModel(_cluster(), [c.fit() for c in again.collectives]).late_extra(2) == \
        pytest.approx(1.7e-3 - table.collectives[0].fit().time(8))


def _count_train_step_collectives(ctx):
    """One train step of a tiny model at dp 2 (the distributed optimizer, as every dp > 1 run), counting the
    blocking dp collectives it makes."""
    import torch
    import torch.distributed as dist

    from model_helpers import build_model
    from realloc.models.config import get_model_config
    from test_model_train import _micro_batches, nll_loss

    cfg = get_model_config("tiny")
    m = build_model(ctx, cfg, 2, 1, 1)
    opt = m.make_optimizer(lr=1e-3)
    counted = []
    names = ("all_reduce", "reduce_scatter_single", "all_gather_single", "all_gather", "all_gather_into_tensor",
             "reduce_scatter_tensor", "broadcast", "barrier")
    saved = {n: getattr(dist, n) for n in names}

    def counting(name):
        def run(*a, **k):
            counted.append(name)
            return saved[name](*a, **k)
        return run

    for n in names:
        setattr(dist, n, counting(n))
    try:
        m.train_step(_micro_batches(3 + ctx.rank, n=2, vocab=cfg.vocab_size), nll_loss, opt)
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    n_local = sum(p.numel() for p in m._trained.values())
    return counted, -(-n_local // GRAD_BUCKET_NUMEL), torch.get_num_threads()


def test_the_runtime_makes_the_blocking_dp_collectives_the_price_counts(tmp_path):
    with GlooPool(2, tmp_path) as pool:
        for counted, buckets, _ in pool.run(_count_train_step_collectives):
            assert len(counted) == train_step_dp_syncs(buckets), counted
            assert counted.count("reduce_scatter_single") == counted.count("all_gather_single") == buckets


def test_both_simulators_agree_with_late_collectives_priced(model):
    from realloc.estimator.cost import CostModel
    from realloc.search import reference
    from realloc.search.build import PlanSpace

    cost = CostModel(model.graph, discover=False)
    cost.comm = CommModel(cost.cluster, [AR, AG, LATE])
    space = PlanSpace.build(model.graph, cost, max_n_mbs=2)
    rng = np.random.default_rng(3)
    for _ in range(60):
        idx = np.array([rng.integers(len(k)) for k in space.problem.candidates], np.int32)
        assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
    # the late waits reach the plans: the all-dp-2 train calls cost more than on the plain fits
    plain = CostModel(model.graph, discover=False)
    plain.comm = CommModel(plain.cluster, [AR, AG])
    mesh = model.cluster.whole
    assert cost.call_cost("actor_train", mesh, S(2, 1, 1), 1).time > plain.call_cost("actor_train", mesh, S(2, 1, 1),
                                                                                    1).time


def test_co_run_times_the_layer_ops_on_every_device_at_once(tmp_path):
    """``realloc profile --co-run``: every tp group of the world times the ops (rank 0's kept), and says so."""
    import dataclasses
    import json
    import subprocess
    import sys

    from realloc.estimator.profile_cli import ProfileJob, default_grid, profiled_blocks, profiled_config

    grid = default_grid(profiled_config("tiny"), 1, 1)
    job = ProfileJob(model_type="tiny", device="cpu", kind="cpu", dtype="fp32", tps=(1, 2), grid=grid,
                     collective_sizes=(2, 4), max_collective_bytes=64, collective_repeats=3)
    assert profiled_blocks(job) == {1: [(0,)], 2: [(0, 1)]}
    co = dataclasses.replace(job, co_run=True)
    assert profiled_blocks(co) == {1: [(0,), (1,), (2,), (3,)], 2: [(0, 1), (2, 3)]}
    out = tmp_path / "tiny.json"
    r = subprocess.run([sys.executable, "-m", "realloc", "profile", "--model", "tiny", "--tp", "1", "--co-run",
                        "--batch-sizes", "1,2", "--seq-lens", "8,16", "--ctx-lens", "8,16", "--repeats", "1",
                        "--warmup", "1", "--max-bytes", "64", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    meta = json.loads(out.read_text())["meta"]
    assert meta["co_run"] is True and "--co-run" in meta["command"]
