"""`realloc profile` for real on this machine (a small grid), and its argument errors (issue 3)."""

import argparse

import pytest

from realloc.api import load_experiment
from realloc.cli import build_parser
from realloc.estimator.cost import CostModel
from realloc.estimator.profile_cli import build_job, main
from realloc.estimator.profile_table import ProfileTable
from realloc.estimator.profiler import ENGINE_KEYS, INTERFACE_KEYS, PROFILED_OPS
from realloc.graph.dataflow import build_graph
from realloc.models.config import get_model_config
from realloc.strategy import ParallelStrategy as S


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["profile", *argv])


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tiny.json"
    args = parse("--model", "tiny", "--tp", "1,2", "--batch-sizes", "1,2", "--seq-lens", "8,16", "--ctx-lens",
                 "8,16", "--max-bytes", "4096", "--warmup", "1", "--repeats", "2", "--quiet", "--out", str(out))
    assert main(args) == 0
    return ProfileTable.load(out)


def test_profile_writes_a_complete_table(profile):
    assert (profile.device_kind, profile.model_type, profile.dtype) == ("cpu", "tiny", "fp32")
    assert sorted(profile.tp) == [1, 2]
    for tp, sub in profile.tp.items():
        keys = {f"{p.value}.{ph.value}" for p, ph in PROFILED_OPS}
        assert keys | set(ENGINE_KEYS) | set(INTERFACE_KEYS) == set(sub.ops)
        assert sub.ops["block.fwd"].batch == [1, 2] and sub.ops["block.fwd"].seq == [8, 16]
        assert sub.ops["block.decode"].seq == [8, 16] and sub.ops["head.decode"].seq == [1]
        assert all(v > 0 for g in sub.ops.values() for row in g.seconds for v in row)
        # optimizer over 1, 2 and 4 layers: more parameters on 1 tp rank than split over 2
        assert [n for n, _ in sub.optimizer] == sorted(n for n, _ in sub.optimizer)
    assert profile.tp[1].optimizer[0][0] > profile.tp[2].optimizer[0][0]
    # engine overheads are robust lines in tokens (b x s; b for a decode step), stored on the layer grid
    for sub in profile.tp.values():
        for key in ENGINE_KEYS:
            g = sub.ops[key]
            per_row = key in ("engine.decode_step", "engine.schedule_step")  # a line in b alone
            assert g.batch == [1, 2] and g.seq == ([1] if per_row else [8, 16])
            if not per_row:
                v = g.seconds
                if min(map(min, v)) > 1e-7:  # an all-noise residual is stored as the floor
                    slope = (v[0][1] - v[0][0]) / 8
                    assert v[1][1] - v[0][0] == pytest.approx(slope * (32 - 8), rel=1e-6, abs=1e-12)
        # PPO's train interface: a line in the generated tokens (8, 32, 128), the same for every batch
        g = sub.ops["interface.train"]
        assert g.seq == [8, 32, 128] and all(row == g.seconds[0] for row in g.seconds)
        v = g.seconds[0]
        if min(v) > 1e-7:
            assert v[2] - v[1] == pytest.approx((v[1] - v[0]) * 96 / 24, rel=1e-6, abs=1e-12)
    ops = {(c.op, c.n) for c in profile.collectives}
    assert ops == {("broadcast", 2), ("all_reduce", 2), ("all_gather", 2), ("p2p", 2), ("all_reduce_late", 2)}
    assert all(c.alpha > 0 or c.beta > 0 for c in profile.collectives)
    assert [x for x, _ in profile.collectives[0].points] == [4, 16, 64, 256, 1024, 4096]
    assert profile.meta["command"].startswith("realloc profile --model tiny --device cpu --tp 1,2")


def test_cost_model_uses_the_profile(profile):
    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))
    measured = CostModel(graph, profile=profile)
    assert measured.layer_costs(get_model_config("tiny")).source == "profile"
    assert measured.layer_costs(get_model_config("tiny-critic")).source == "profile"  # same trunk
    assert measured.comm.measured
    roof = CostModel(graph, discover=False)
    assert roof.layer_costs(get_model_config("tiny")).source == "roofline"
    mesh = graph.spec.cluster.whole
    for call in ("actor_gen", "ref_inf", "critic_inf", "actor_train"):
        c = measured.call_cost(call, mesh, S(1, 2, 1), 1)
        assert c.time > 0 and c.time != roof.call_cost(call, mesh, S(1, 2, 1), 1).time
        assert c.overhead > 0  # the engine's own overheads were measured


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match=r"--tp 3: tp=3 must divide the 4 attention heads of tiny"):
        build_job(parse("--model", "tiny", "--tp", "1,3"))
    with pytest.raises(ValueError, match="--tp must be comma-separated positive integers"):
        build_job(parse("--model", "tiny", "--tp", "x"))
    with pytest.raises(ValueError, match="nothing to profile"):
        build_job(parse("--model", "rule"))
    with pytest.raises(ValueError, match="--device cuda needs --kind"):
        build_job(parse("--model", "tiny", "--device", "cuda"))
    with pytest.raises(ValueError, match="exceeds the 256 positions of tiny"):
        build_job(parse("--model", "tiny", "--ctx-lens", "8,1024"))
    with pytest.raises(ValueError, match="unknown model_type 'nope'"):
        build_job(parse("--model", "nope"))


def test_tp_grids_are_smoothed_by_a_bilinear_fit():
    from realloc.estimator.profile_cli import smooth_grid
    from realloc.estimator.profile_table import OpGrid

    def f(b, s):
        return 1e-3 + 2e-5 * b + 1e-5 * s + 3e-6 * b * s

    exact = OpGrid(batch=[1, 2, 4, 8], seq=[8, 16, 32], seconds=[[f(b, s) for s in (8, 16, 32)] for b in (1, 2, 4, 8)])
    fit, rms = smooth_grid(exact)
    assert rms == pytest.approx(0.0, abs=1e-9)
    assert sum(fit.seconds, []) == pytest.approx(sum(exact.seconds, []), rel=1e-9)
    # one point 50% high (a slow phase of the machine) moves the fit only a little there
    spiked = exact.model_copy(update={"seconds": [row[:] for row in exact.seconds]})
    spiked.seconds[2][1] *= 1.5
    fit, rms = smooth_grid(spiked)
    assert abs(fit.seconds[2][1] / f(4, 16) - 1) < 0.15 and rms > 0.05
    # a grid along the batch only (a one-token op) is a line in b
    flat = OpGrid(batch=[1, 2, 4, 8], seq=[1], seconds=[[1e-3 + 1e-4 * b] for b in (1, 2, 4, 8)])
    assert sum(smooth_grid(flat)[0].seconds, []) == pytest.approx(sum(flat.seconds, []), rel=1e-9)
