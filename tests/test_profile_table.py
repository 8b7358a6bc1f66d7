"""Profile tables: JSON round trip, version check, interpolation and roofline extrapolation (issue 3)."""

import json

import pytest

from realloc.api import load_experiment
from realloc.estimator.comm import CommModel
from realloc.estimator.opcount import Part, Phase
from realloc.estimator.profile_table import (PROFILE_FORMAT_VERSION, ModelArch, OpGrid, ProfiledCosts, ProfileTable,
                                             TpTable, fit_line, interp_axis, interp_grid)
from realloc.estimator.roofline import RooflineCosts
from realloc.models.config import get_model_config

TINY = get_model_config("tiny")


def make_table(fn, batch=(1, 2, 4, 8), seq=(8, 16, 32), tps=(1,)) -> ProfileTable:
    """A table whose every op is ``fn(key, tp, b, s)`` on the grid."""
    from realloc.estimator.profiler import PROFILED_OPS, FLAT_OPS

    subs = {}
    for tp in tps:
        ops = {}
        for part, phase in PROFILED_OPS:
            key = f"{part.value}.{phase.value}"
            axis = (1,) if (part, phase) in FLAT_OPS else seq
            ops[key] = OpGrid(batch=list(batch), seq=list(axis),
                              seconds=[[fn(key, tp, b, s) for s in axis] for b in batch])
        subs[tp] = TpTable(ops=ops, optimizer=[(1000, 1e-3 + 1000 * 2e-8), (3000, 1e-3 + 3000 * 2e-8)])
    return ProfileTable(device_kind="cpu", model_type="tiny", dtype="fp32", arch=ModelArch.of(TINY), tp=subs,
                        meta={"command": "test"})


def test_json_round_trip(tmp_path):
    table = make_table(lambda k, tp, b, s: 1e-4 * b * s + 1e-5)
    path = tmp_path / "cpu" / "tiny.json"
    table.save(path)
    again = ProfileTable.load(path)
    assert again == table
    raw = json.loads(path.read_text())
    assert raw["format"] == "realloc-profile" and raw["version"] == PROFILE_FORMAT_VERSION
    assert raw["tp"]["1"]["ops"]["block.fwd"]["seconds"][1][2] == pytest.approx(1e-4 * 2 * 32 + 1e-5)


def test_version_and_format_errors_are_clear(tmp_path):
    table = make_table(lambda k, tp, b, s: 1e-3)
    raw = json.loads(table.to_json())
    raw["version"] = PROFILE_FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=r"profile format version 2 is not supported .* re-create it with `realloc "
                                         r"profile`"):
        ProfileTable.from_json(json.dumps(raw), where="x.json")
    with pytest.raises(ValueError, match="not a realloc profile table"):
        ProfileTable.from_json(json.dumps({"version": 1}), where="x.json")
    raw["version"] = PROFILE_FORMAT_VERSION
    raw["tp"]["1"]["ops"]["block.fwd"]["seconds"] = [[1.0]]
    with pytest.raises(ValueError, match=r"x.json: field 'tp.1.ops.block.fwd'.*4 x 3 grid"):
        ProfileTable.from_json(json.dumps(raw), where="x.json")
    with pytest.raises(ValueError, match="does not exist; create it with `realloc profile`"):
        ProfileTable.load(tmp_path / "missing.json")


def test_interp_axis_linear_inside_and_roofline_outside():
    pts, vals = [2, 4, 8], [10.0, 14.0, 30.0]
    roof = lambda x: 3.0 * x * x  # noqa: E731  - any increasing shape
    assert interp_axis(pts, vals, 3, roof) == pytest.approx(12.0)
    assert interp_axis(pts, vals, 6, roof) == pytest.approx(22.0)
    assert interp_axis(pts, vals, 4, roof) == pytest.approx(14.0)
    # beyond the grid: t(edge) + k (R(q) - R(edge)), k = (30 - 14) / (R(8) - R(4))
    k = 16.0 / (roof(8) - roof(4))
    assert interp_axis(pts, vals, 16, roof) == pytest.approx(30.0 + k * (roof(16) - roof(8)))
    # a quantity affine in the roofline is extrapolated exactly, on both sides
    f = lambda x: 5.0 + 0.25 * roof(x)  # noqa: E731
    vals = [f(p) for p in pts]
    for q in (1, 12, 40):
        assert interp_axis(pts, vals, q, roof) == pytest.approx(f(q))
    # one point: scale by the roofline ratio
    assert interp_axis([4], [2.0], 8, roof) == pytest.approx(2.0 * roof(8) / roof(4))


def test_interp_grid_is_bilinear_inside():
    grid = OpGrid(batch=[1, 4], seq=[8, 16], seconds=[[1.0, 2.0], [4.0, 10.0]])
    roof = lambda b, s: b * s  # noqa: E731
    assert interp_grid(grid, 1, 8, roof) == 1.0
    assert interp_grid(grid, 4, 16, roof) == 10.0
    # b = 2.5 is halfway along batch, s = 12 halfway along seq: mean of the four corners
    assert interp_grid(grid, 2.5, 12, roof) == pytest.approx((1 + 2 + 4 + 10) / 4)
    # outside along seq: rows extrapolated with the roofline b*s, k from the two seq columns
    k_b1 = (2.0 - 1.0) / (16 - 8)
    assert interp_grid(grid, 1, 32, roof) == pytest.approx(2.0 + k_b1 * (32 - 16))


def test_grid_rejects_unsorted_axes():
    with pytest.raises(ValueError, match="strictly increasing"):
        OpGrid(batch=[2, 1], seq=[8], seconds=[[1.0], [1.0]])
    with pytest.raises(ValueError, match="positive"):
        OpGrid(batch=[1], seq=[8], seconds=[[0.0]])


def test_fit_line():
    alpha, beta = fit_line([(1000, 1e-3 + 2e-5), (3000, 1e-3 + 6e-5), (2000, 1e-3 + 4e-5)])
    assert alpha == pytest.approx(1e-3) and beta == pytest.approx(2e-8)


@pytest.fixture(scope="module")
def tiny_cluster():
    return load_experiment("experiments/ppo_tiny.py").cluster


def test_profiled_costs_interpolate_and_extrapolate(tiny_cluster):
    comm = CommModel(tiny_cluster)
    roof = RooflineCosts(TINY, tiny_cluster.hardware, comm)
    # measured = 2x the roofline + 50 us of fixed cost: affine in the roofline, so lookups are exact
    def measured(key, tp, b, s):
        part, phase = key.split(".")
        c, x = roof.op(Part(part), Phase(phase), tp, b, s)
        return 2 * (c + x) + 5e-5

    costs = ProfiledCosts(make_table(measured), TINY, roof, comm)
    for b, s in [(2, 16), (8, 32), (64, 16), (4, 200), (128, 512), (3, 20)]:
        c, x = costs.op(Part.BLOCK, Phase.FWD, 1, b, s)
        want = measured("block.fwd", 1, b, s)
        if (b, s) == (3, 20):  # between grid points: linear, not the roofline curve
            assert c + x == pytest.approx((measured("block.fwd", 1, 2, 16) * 0.5 * 0.75
                                           + measured("block.fwd", 1, 4, 16) * 0.5 * 0.75
                                           + measured("block.fwd", 1, 2, 32) * 0.5 * 0.25
                                           + measured("block.fwd", 1, 4, 32) * 0.5 * 0.25), rel=1e-9)
        else:
            assert c + x == pytest.approx(want, rel=1e-9)
    # the optimizer line through its two measured points
    assert costs.optimizer(2000) == pytest.approx(1e-3 + 2000 * 2e-8)
    # a tp the table lacks: scaled from tp=1 by the roofline's compute ratio, collectives modelled
    c2, x2 = costs.op(Part.BLOCK, Phase.FWD, 2, 8, 16)
    rc1, rx1 = roof.op(Part.BLOCK, Phase.FWD, 1, 8, 16)
    rc2, rx2 = roof.op(Part.BLOCK, Phase.FWD, 2, 8, 16)
    assert x2 == pytest.approx(rx2) and rx2 > 0
    assert c2 == pytest.approx(measured("block.fwd", 1, 8, 16) * rc2 / rc1)


def test_engine_overheads_are_linear_in_tokens(tiny_cluster):
    comm = CommModel(tiny_cluster)
    roof = RooflineCosts(TINY, tiny_cluster.hardware, comm)
    table = make_table(lambda k, tp, b, s: 1e-3)
    sub = table.tp[1]
    ops = dict(sub.ops)
    ops["engine.fwd"] = OpGrid(batch=[1, 4], seq=[8, 16], seconds=[[1e-3 + 1e-6 * b * s for s in (8, 16)]
                                                                    for b in (1, 4)])
    ops["engine.decode_step"] = OpGrid(batch=[1, 4], seq=[1], seconds=[[2e-4 + 1e-5 * b] for b in (1, 4)])
    table = table.model_copy(update={"tp": {1: TpTable(ops=ops, optimizer=sub.optimizer)}})
    costs = ProfiledCosts(table, TINY, roof, comm)
    assert costs.engine("engine.fwd", 1, 64, 100) == pytest.approx(1e-3 + 1e-6 * 6400)
    assert costs.engine("engine.decode_step", 1, 16, 500) == pytest.approx(2e-4 + 1e-5 * 16)
    assert costs.engine("engine.decode_step", 2, 16, 500) == pytest.approx(2e-4 + 1e-5 * 16)  # nearest tp
    assert costs.engine("engine.gen_call", 1, 4, 8) is None
    assert roof.engine("engine.fwd", 1, 4, 8) is None


def test_theil_sen_ignores_an_outlier():
    from realloc.estimator.profile_cli import theil_sen

    pts = [(x, 1e-3 + 2e-6 * x) for x in (8, 32, 128, 512, 2048)] + [(64, 0.5)]
    alpha, beta = theil_sen(pts)
    assert alpha == pytest.approx(1e-3, rel=1e-6) and beta == pytest.approx(2e-6, rel=1e-6)
    assert theil_sen([(1, -1.0), (2, -2.0)]) == (0.0, 0.0)  # never negative


def test_ppo_train_interface_overhead_is_added_once_per_train_call():
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.strategy import ParallelStrategy as S

    base = make_table(lambda k, tp, b, s: 1e-4 * b * s + 1e-5)
    sub = base.tp[1]
    # 1 ms + 10 us per generated token, whatever the batch
    line = OpGrid(batch=[1, 2], seq=[8, 32], seconds=[[1e-3 + 8e-5, 1e-3 + 32e-5]] * 2)
    with_iface = base.model_copy(update={"tp": {1: TpTable(ops={**sub.ops, "interface.train": line},
                                                           optimizer=sub.optimizer)}})
    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))  # gen_len 8, 2 PPO mini-batches
    one = graph.spec.cluster.mesh("localhost:0")
    plain = CostModel(graph, profile=base).call_cost("actor_train", one, S(1, 1, 1), 1)
    extra = CostModel(graph, profile=with_iface).call_cost("actor_train", one, S(1, 1, 1), 1)
    assert extra.time - plain.time == pytest.approx(1e-3 + 8 * 1e-5)
    assert extra.overhead - plain.overhead == pytest.approx(1e-3 + 8 * 1e-5)
    # linear beyond the measured lengths: 128 generated tokens
    costs = ProfiledCosts(with_iface, TINY, RooflineCosts(TINY, graph.spec.cluster.hardware,
                                                          CommModel(graph.spec.cluster)), CommModel(graph.spec.cluster))
    assert costs.interface("interface.train", 1, 128) == pytest.approx(1e-3 + 128e-5)
    assert costs.interface("interface.train", 2, 8) == pytest.approx(1e-3 + 8e-5)  # nearest tp
    assert ProfiledCosts(base, TINY, costs.roofline, costs.comm).interface("interface.train", 1, 8) is None


def test_train_step_overhead_scales_with_the_parameters_it_passes_over():
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.strategy import ParallelStrategy as S

    base = make_table(lambda k, tp, b, s: 1e-4 * b * s + 1e-5)
    sub = base.tp[1]
    flat = OpGrid(batch=[1, 32], seq=[8, 32], seconds=[[2e-3, 2e-3]] * 2)  # 2 ms per optimizer step, measured
    with_step = base.model_copy(update={"tp": {1: TpTable(ops={**sub.ops, "engine.train_step": flat},
                                                          optimizer=sub.optimizer)}})
    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))  # 2 PPO mini-batches: 2 steps per call
    one = graph.spec.cluster.mesh("localhost:0")
    plain = CostModel(graph, profile=base).call_cost("actor_train", one, S(1, 1, 1), 1)
    extra = CostModel(graph, profile=with_step).call_cost("actor_train", one, S(1, 1, 1), 1)
    # measured on a one-layer tiny model (58,560 parameters: 2 x 64x64 embeddings, a 64 norm, one block of
    # 50,304), applied to all 4 layers (209,472)
    assert extra.time - plain.time == pytest.approx(2 * 2e-3 * 209472 / 58560)


def test_train_overheads_split_into_a_line_per_micro_batch_and_a_constant_per_step():
    from realloc.estimator.profile_cli import split_train_overheads

    # one micro-batch costs 1 ms + 1 us per token beyond its layer ops; the optimizer step 3 ms
    xs = (8, 64, 256, 1024, 4096)
    pts = [(x, 4e-3 + 1e-6 * x, 5e-3 + 2e-6 * x) for x in xs]
    (a_mb, b_mb), (a_step, b_step) = split_train_overheads(pts)
    assert (a_mb, b_mb) == (pytest.approx(1e-3), pytest.approx(1e-6))
    assert (a_step, b_step) == (pytest.approx(3e-3), 0.0)
    # noise that tilts r1 alone (one slow single-micro-batch run at a large point) moves neither
    noisy = pts[:-1] + [(4096, 4e-3 + 1e-6 * 4096 + 0.05, 5e-3 + 2e-6 * 4096 + 0.05)]
    (a_mb2, b_mb2), (a_step2, b_step2) = split_train_overheads(noisy)
    assert b_step2 == 0.0 and a_step2 == pytest.approx(3e-3, rel=1e-6)
