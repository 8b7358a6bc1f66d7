"""The fused pipeline schedule search (csrc/fused_schedule.*, rlhfuse.txt §5.2) against the plain-Python
reference (realloc/search/fused_reference.py): the evaluation of an order, brute force on tiny problems,
the lower bound, the memory cap, bad input."""

from __future__ import annotations

import random

import pytest

from realloc import _C
from realloc.search.fused_reference import RefModel, RefProblem, brute_force, device_orders, evaluate, lower_bound


def make(n: int, pp_a: int, m_a: int, pp_b: int, m_b: int, seed: int, p2p: float = 0.0):
    """The same random problem for C++ and the reference: stage times and activations drawn per stage."""
    rng = random.Random(seed)

    def model(pp: int, m: int) -> RefModel:
        fwd = [round(rng.uniform(0.5, 2.0), 3) for _ in range(pp)]
        return RefModel(pp, m, fwd, [round(f * rng.uniform(1.5, 2.5), 3) for f in fwd],
                        [round(rng.uniform(0.5, 3.0), 3) for _ in range(pp)])

    a, b = model(pp_a, m_a), model(pp_b, m_b)
    ref = RefProblem(n, a, b, p2p)
    cpp = _C.FusedProblem(n, a.pp, a.n_micro, list(a.fwd), list(a.bwd), list(a.act),
                          b.pp, b.n_micro, list(b.fwd), list(b.bwd), list(b.act), p2p)
    return cpp, ref


def random_order(ref: RefProblem, rng: random.Random) -> list[list[tuple[int, int, int]]]:
    """A random order that keeps each model's micro-batch order (it may deadlock)."""
    out = []
    for _ in range(ref.n_devices):
        nxt = {(m, bw): 0 for m in (0, 1) for bw in (0, 1)}
        n = {0: ref.a.n_micro, 1: ref.b.n_micro}
        seq = []
        while len(seq) < 2 * (n[0] + n[1]):
            options = [(m, bw) for (m, bw), mb in nxt.items() if mb < n[m] and (not bw or nxt[(m, 0)] > mb)]
            m, bw = rng.choice(options)
            seq.append((m, bw, nxt[(m, bw)]))
            nxt[(m, bw)] += 1
        out.append(seq)
    return out


def assert_same(cpp_eval: dict, ref_eval) -> None:
    assert cpp_eval["valid"] == ref_eval.valid
    if ref_eval.valid:
        assert cpp_eval["device_peak"] == pytest.approx(ref_eval.device_peak, abs=1e-9)
        assert cpp_eval["makespan"] == pytest.approx(ref_eval.makespan, rel=1e-12)
        assert cpp_eval["device_end"] == pytest.approx(ref_eval.device_end, rel=1e-12)


SHAPES = [(2, 2, 3, 2, 2), (4, 4, 4, 2, 2), (4, 2, 3, 4, 5), (6, 3, 4, 6, 3), (8, 8, 8, 4, 4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_evaluation_matches_reference(shape):
    rng = random.Random(7)
    cpp, ref = make(*shape, seed=sum(shape), p2p=0.1)
    orders = [cpp.serial_1f1b(), cpp.greedy(), cpp.greedy(inflight_1f1b=True), cpp.greedy(primary=0),
              cpp.greedy(primary=1, slack=1.0), cpp.greedy(primary=2, extra_warmup=1)]
    orders += [random_order(ref, rng) for _ in range(20)]
    n_valid = 0
    for order in orders:
        ref_eval = evaluate(ref, [list(s) for s in order])
        assert_same(cpp.evaluate(order), ref_eval)
        n_valid += ref_eval.valid
    assert n_valid >= 6  # the constructed orders never deadlock
    res = cpp.search(iterations=2000, memory_iterations=2000, seed=3)
    assert_same(res["eval"], evaluate(ref, [list(s) for s in res["order"]]))


def test_alone_1f1b_is_the_textbook_time_and_memory():
    # uniform stages: 1F1B takes (M + pp - 1)(f + b) and stage s holds min(pp - s, M) micro-batches
    pp, m, f, b = 4, 6, 1.0, 2.0
    cpp = _C.FusedProblem(pp, pp, m, [f] * pp, [b] * pp, [1.0] * pp, pp, 2, [f] * pp, [b] * pp, [1.0] * pp)
    alone = cpp.alone_1f1b(0)
    assert alone["makespan"] == pytest.approx((m + pp - 1) * (f + b))
    assert alone["device_peak"] == [min(pp - s, m) for s in range(pp)]


@pytest.mark.parametrize("shape,seed", [((2, 2, 2, 2, 1), 1), ((2, 2, 2, 1, 1), 2), ((2, 1, 2, 2, 1), 3),
                                        ((3, 3, 1, 3, 1), 4), ((2, 2, 1, 1, 2), 5)])
def test_search_reaches_brute_force_optimum(shape, seed):
    cpp, ref = make(*shape, seed=seed, p2p=0.05 * seed)
    best, _ = brute_force(ref)
    res = cpp.search(iterations=3000, memory_iterations=1000, restarts=2, seed=0)
    assert lower_bound(ref) <= best + 1e-12
    assert res["lower_bound"] == pytest.approx(lower_bound(ref), rel=1e-12)
    assert res["eval"]["makespan"] == pytest.approx(best, rel=1e-12)


def test_brute_force_enumerates_every_order():
    # interleavings of A's 2 orders (F0 F1 B0 B1, F0 B0 F1 B1) and B's 1 with 6 slots: 2 * C(6, 2)
    assert len(list(device_orders(2, 1))) == 2 * 15


@pytest.mark.parametrize("seed", range(4))
def test_search_never_beats_lower_bound_and_keeps_cap(seed):
    cpp, ref = make(8, 8, 6, 4, 5, seed=seed, p2p=0.02)
    serial_peak = cpp.search(iterations=0, memory_iterations=0, restarts=1)["serial"]["peak"]
    res = cpp.search(iterations=3000, memory_iterations=3000, seed=seed, memory_cap=serial_peak * 1.2)
    ev = evaluate(ref, [list(s) for s in res["order"]])
    assert ev.valid and ev.makespan >= lower_bound(ref) - 1e-9
    assert max(ev.device_peak) <= serial_peak * 1.2 + 1e-9
    # the search never ends above its start, and the start never above the serial run
    assert res["eval"]["makespan"] <= res["start"]["makespan"] <= res["serial"]["makespan"] + 1e-9


def test_table3_lower_bound_by_hand():
    # rlhfuse.txt Table 3, 65B/33B, PP 16/8, 32 micro-batches (two 33B pipelines of 16): stage times
    # proportional to parameters per stage, backward = 2 x forward. Serial 1F1B = (M + pp - 1)(f + b)
    # per model; the bound is set by device 8 (A's stage 8, B's stage 7): B's first forward arrives
    # after 7 B stages, its last backward has 7 B stages to go, and the device does all of its work.
    fa, fb = 65 / 16, 33 / 8
    cpp = _C.FusedProblem(16, 16, 32, [fa] * 16, [2 * fa] * 16, [1.0] * 16, 8, 16, [fb] * 8, [2 * fb] * 8,
                          [1.0] * 8)
    serial = (32 + 15) * 3 * fa + (16 + 7) * 3 * fb
    lb = 7 * fb + 32 * 3 * fa + 16 * 3 * fb + 7 * 2 * fb
    assert cpp.lower_bound() == pytest.approx(lb)
    assert serial / lb == pytest.approx(1.27, abs=0.005)  # the paper's LB column


def test_bad_input_is_one_value_error():
    with pytest.raises(ValueError, match="pp 3 must divide"):
        _C.FusedProblem(4, 3, 2, [1.0] * 3, [1.0] * 3, [1.0] * 3, 4, 2, [1.0] * 4, [1.0] * 4, [1.0] * 4)
    with pytest.raises(ValueError, match="one entry per stage"):
        _C.FusedProblem(2, 2, 2, [1.0], [1.0] * 2, [1.0] * 2, 2, 2, [1.0] * 2, [1.0] * 2, [1.0] * 2)
    cpp, _ = make(2, 2, 2, 2, 2, seed=0)
    order = cpp.serial_1f1b()
    order[0][0], order[0][1] = order[0][1], order[0][0]  # F1 before F0 of model A on device 0
    with pytest.raises(ValueError, match="micro-batch order"):
        cpp.evaluate(order)
    with pytest.raises(ValueError, match="memory_cap"):
        cpp.search(memory_cap=1e-6)


def test_timeline_panel_has_every_pass_at_the_reference_times():
    from realloc.search.fused_reference import pass_times
    from realloc.search.fused_report import fused_panel

    cpp, ref = make(4, 4, 3, 2, 2, seed=11, p2p=0.1)
    order = [[tuple(p) for p in s] for s in cpp.search(iterations=500, memory_iterations=0)["order"]]
    panel = fused_panel(ref, order, ("actor", "critic"))
    times = pass_times(ref, order)
    assert len(panel.boxes) == len(times) == 4 * 2 * (3 + 2)
    for b in panel.boxes:
        model = 0 if b.label.startswith("actor") else 1
        bw = int(b.label.endswith("backward"))
        assert times[(b.lo, (model, bw, int(b.detail.split()[-1])))] == (b.start, b.end)
    assert panel.iteration_ends[0][1] == pytest.approx(cpp.evaluate(order)["makespan"])
