"""The C++ plan simulator against the plain-Python reference, and against hand-computed schedules."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from realloc.search import reference
from realloc.search.problem import CandidateArrays, PairCosts, SearchProblem

GiB = 2**30


def random_candidates(rng: np.random.Generator, n_devices: int, n_layouts: int, n: int,
                      recompute: bool = False) -> CandidateArrays:
    """``n`` random placements; with ``recompute`` each also comes recomputing activations (a twin of the
    same layout that takes longer and keeps less dynamic memory, as a training call's candidates)."""
    lo, hi, width = [], [], []
    for _ in range(n):
        a = int(rng.integers(0, n_devices))
        b = int(rng.integers(a + 1, n_devices + 1))
        size = b - a
        divs = [d for d in range(1, size + 1) if size % d == 0]
        lo.append(a)
        hi.append(b)
        width.append(int(rng.choice(divs)))
    # Few distinct times, so that ready-time ties (and the tie rule) happen often.
    time = rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.25], size=n)
    pp = [(b - a) // w for a, b, w in zip(lo, hi, width)]
    pool = lambda: rng.integers(0, 4, size=sum(pp)) * GiB // 2  # noqa: E731
    static, dynamic, param = pool(), pool(), pool()
    layout, mesh_id, shape = rng.integers(0, n_layouts, n), rng.integers(0, 3, n), rng.integers(0, 3, n)
    twin = np.full(n, -1)
    if recompute:
        lo, hi, width, layout, mesh_id = lo * 2, hi * 2, width * 2, np.r_[layout, layout], np.r_[mesh_id, mesh_id]
        shape = np.r_[shape, shape + 3]
        time = np.r_[time, time + rng.choice([0.25, 0.5], size=n)]
        static, param = np.r_[static, static], np.r_[param, param]
        dynamic = np.r_[dynamic, dynamic // 2]
        pp = pp * 2
        twin = np.r_[np.arange(n, 2 * n), np.arange(n)]
    return CandidateArrays(dev_lo=lo, dev_hi=hi, stage_width=width, layout=layout, mesh_id=mesh_id,
                           shape_class=shape, time=time, mem_offset=np.r_[0, np.cumsum(pp)], mem_static=static,
                           mem_dynamic=dynamic, mem_param=param, twin=twin)


def random_problem(rng: np.random.Generator) -> SearchProblem:
    n_devices = int(rng.choice([1, 2, 3, 4, 8, 16]))
    n_calls = int(rng.integers(1, 8))
    n_models = int(rng.integers(1, min(n_calls, 4) + 1))
    call_model = [int(m) for m in rng.permutation(np.r_[np.arange(n_models), rng.integers(0, n_models, n_calls - n_models)])]
    model_home = [int(rng.choice([c for c in range(n_calls) if call_model[c] == m])) for m in range(n_models)]
    n_layouts = [int(rng.integers(1, 5)) for _ in range(n_models)]
    cands = tuple(random_candidates(rng, n_devices, n_layouts[call_model[c]], int(rng.integers(1, 6)),
                                    recompute=bool(rng.random() < 0.3))
                  for c in range(n_calls))
    data, order, carry = [], [], []
    for u in range(n_calls):
        for v in range(u + 1, n_calls):
            r = rng.random()
            if r < 0.3:
                data.append((u, v))
            elif r < 0.45:
                order.append((u, v))
    for u in range(n_calls):
        for v in range(n_calls):
            if rng.random() < 0.12:
                carry.append((u, v))

    def table(rows: int, cols: int) -> PairCosts:
        # Most pairs priced (some at zero cost); the rest provisional.
        t = PairCosts(rows, cols, provisional=float(rng.choice([0.0, 0.25])))
        for a in range(rows):
            for b in range(cols):
                if rng.random() < 0.85:
                    t.known[a, b] = float(rng.choice([0.0, 0.25, 0.5, 1.0, 0.125]))
        return t

    # Hosts of a few devices, sometimes with fewer cores than devices (processor sharing).
    per_host = int(rng.choice([d for d in (1, 2, 4) if n_devices % d == 0]))
    cores = float(rng.choice([0.0, 0.0, 1.0, 1.5, per_host])) if per_host > 1 else 0.0
    return SearchProblem(
        dispatch_latency=float(rng.choice([0.0, 0.0625])), devices_per_node=per_host, cores_per_node=cores,
        n_devices=n_devices, device_memory=int(rng.integers(1, 12)) * GiB // 2,
        call_names=tuple(f"c{i}" for i in range(n_calls)), call_model=tuple(call_model),
        model_names=tuple(f"m{i}" for i in range(n_models)), model_home=tuple(model_home), candidates=cands,
        order_edges=tuple(order), carry_edges=tuple(carry), data_edges=tuple(data),
        data_costs=tuple(table(n_layouts[call_model[u]], n_layouts[call_model[v]]) for u, v in data),
        realloc_costs=tuple(table(n_layouts[m], n_layouts[m]) for m in range(n_models)),
        n_iterations=int(rng.integers(3, 6)), oom_alpha=float(rng.choice([10.0, 100.0])))


def assert_agrees(cpp, p: SearchProblem, plan, tag) -> tuple[dict, list]:
    """The C++ simulator against the Python reference on one plan: the evaluation, and every schedule row's kind,
    call, other call, iteration, start and end. Returns the evaluation and the C++ schedule."""
    got, want = cpp.evaluate(plan), reference.evaluate(p, plan)
    assert got == want, (tag, plan, got, want)
    sched = cpp.schedule(plan)
    want_sched = [(r["kind"], r["call"], r["other"], r["iteration"], r["start"], r["end"])
                  for r in reference.schedule(p, plan)]
    assert [r[:6] for r in sched] == want_sched, tag
    return want, sched


def random_plan(rng: np.random.Generator, p: SearchProblem) -> np.ndarray:
    return np.array([rng.integers(0, len(k)) for k in p.candidates], np.int32)


def bounded_evaluations(rng: np.random.Generator, make_problem, n_problems: int = 200,
                        never_better: bool = False) -> tuple[int, int]:
    """The MCMC's early rejection on ``n_problems`` problems of ``make_problem(rng)``, two plans each: a bounded run
    that completes equals evaluate(); one that stops costs more than its limit (and, with ``never_better``, is no
    better than the best it was given). Returns (stopped, completed)."""
    n_stopped = n_complete = 0
    for _ in range(n_problems):
        p = make_problem(rng)
        cpp = p.to_cpp()
        for _ in range(2):
            plan = random_plan(rng, p)
            full = cpp.evaluate(plan)
            best = cpp.evaluate(random_plan(rng, p))
            limit = full["cost"] * float(rng.choice([0.3, 0.8, 0.99, 1.0, 1.5]))
            got = cpp.evaluate_bounded(plan, limit, best["cost"], best["feasible"])
            got.pop("simulated")
            if got.pop("complete"):
                n_complete += 1
                assert got == full
            else:
                n_stopped += 1
                assert full["cost"] > limit
                if never_better:
                    better = full["feasible"] if full["feasible"] != best["feasible"] else full["cost"] < best["cost"]
                    assert not better
    return n_stopped, n_complete


def test_cpp_matches_python_reference_on_1000_random_graphs_and_plans():
    rng = np.random.default_rng(1234)
    n_feasible = n_oom = n_transfers = n_inexact = n_shared = n_stretched = n_recompute = 0
    for trial in range(1000):
        p = random_problem(rng)
        cpp = p.to_cpp()
        for _ in range(2):
            plan = random_plan(rng, p)
            n_recompute += sum(int(k.twin[i]) >= 0 and int(k.twin[i]) < i for k, i in zip(p.candidates, plan))
            want, sched = assert_agrees(cpp, p, plan, trial)
            mem = cpp.memory(plan)
            static, peak, _ = reference.device_memory(p, plan)
            assert mem["device_static"] == static and mem["device_peak"] == peak, trial
            assert {tuple(r) for r in cpp.missing(plan).tolist()} == reference.missing_pairs(p, plan), trial
            n_inexact += not want["exact"]
            n_feasible += want["feasible"]
            n_oom += not want["feasible"]
            n_transfers += sum(r[0] != 0 and r[5] > r[4] for r in sched)
            if p.shares_cores:
                n_shared += 1
                # a node that took longer than its cost ran while its host was oversubscribed
                nodes = reference._build_nodes(p, plan)
                n_stretched += any(r["end"] - r["start"] > nd.cost for r, nd in zip(reference.schedule(p, plan), nodes))
    # The random problems exercise both memory outcomes, real transfer nodes and shared cores.
    assert n_feasible > 100 and n_oom > 100 and n_transfers > 1000 and n_inexact > 100
    assert n_shared > 200 and n_stretched > 100 and n_recompute > 200


def test_bounded_evaluation_stops_only_for_plans_proven_above_the_limit():
    """The MCMC's early rejection (Evaluator::evaluate_bounded): a run that completes equals evaluate();
    one that stops costs more than the limit and is no better than the best."""
    rng = np.random.default_rng(99)
    n_stopped = n_complete = n_chain = n_unsimulated = 0
    for _ in range(300):
        p = random_problem(rng)
        cpp = p.to_cpp()
        n_chain += cpp.iterations_chain
        for _ in range(3):
            plan = random_plan(rng, p)
            full = cpp.evaluate(plan)
            best = cpp.evaluate(random_plan(rng, p))
            limit = full["cost"] * float(rng.choice([0.3, 0.8, 0.99, 1.0, 1.5]))
            got = cpp.evaluate_bounded(plan, limit, best["cost"], best["feasible"])
            simulated = got.pop("simulated")
            if got.pop("complete"):
                n_complete += 1
                assert got == full
            else:
                n_stopped += 1
                n_unsimulated += not simulated
                assert full["cost"] > limit
                better = full["feasible"] if full["feasible"] != best["feasible"] else full["cost"] < best["cost"]
                assert not better
                assert got["peak_memory"] == full["peak_memory"] and got["feasible"] == full["feasible"]
    assert n_stopped > 100 and n_complete > 100 and 0 < n_chain < 300
    assert n_unsimulated > 25  # the path bound proved some before simulating them (54 with this seed)


def test_path_bound_rejects_before_simulating_only_plans_above_the_limit():
    # gen (2 s, device 0) -> 0.5 s transfer -> train (3 s, device 1) -> gen of the next iteration: every
    # iteration is that 5.5 s path, which the path bound sees without simulating (Evaluator::find_paths).
    p = _one_device_problem([2.0, 3.0], data=[(0, 1)], carry=[(1, 0)], meshes=[(0, 1), (1, 2)], data_cost=0.5)
    cpp, plan = p.to_cpp(), np.zeros(2, np.int32)
    assert cpp.evaluate(plan)["time"] == 5.5
    below = cpp.evaluate_bounded(plan, 5.4, 0.0, True)
    assert not below["complete"] and not below["simulated"]
    above = cpp.evaluate_bounded(plan, 5.6, 0.0, True)
    assert above["complete"] and above["simulated"] and above["time"] == 5.5
    # 2 GiB on a 1 GiB device: the cost is 5.5 s x oom_alpha 100 x (1 + 1 GiB / 1 GiB) = 1100 s
    big = dataclasses.replace(p.candidates[0], mem_static=[2 * GiB])
    oom = dataclasses.replace(p, candidates=(big, p.candidates[1])).to_cpp()
    assert oom.evaluate(plan)["cost"] == 1100.0
    assert not oom.evaluate_bounded(plan, 1000.0, 0.0, True)["simulated"]
    assert oom.evaluate_bounded(plan, 1200.0, 0.0, True)["complete"]


def test_one_evaluator_follows_a_walk_of_plans_exactly():
    """The MCMC's evaluator keeps what a plan determines and redoes only what the calls that changed
    touch (csrc/simulator.h). Along walks that change one or two calls at a time and often go back to
    the plan before (as after a rejected proposal), with pipeline stages of equal bytes (which the memory
    check merges into runs), it agrees with the reference."""
    rng = np.random.default_rng(7)
    n_merged = n_plans = 0
    for _ in range(100):
        p = random_problem(rng)
        cands = []
        for k in p.candidates:
            pools = [k.mem_static.copy(), k.mem_dynamic.copy(), k.mem_param.copy()]
            for i in range(len(k)):
                for s in range(k.mem_offset[i] + 1, k.mem_offset[i + 1]):
                    if rng.random() < 0.5:  # this stage holds what the one before holds
                        for pool in pools:
                            pool[s] = pool[s - 1]
                        n_merged += 1
            cands.append(dataclasses.replace(k, mem_static=pools[0], mem_dynamic=pools[1], mem_param=pools[2]))
        p = dataclasses.replace(p, candidates=tuple(cands))
        cpp = p.to_cpp()
        plans = [random_plan(rng, p)]
        for _ in range(11):
            plan = (plans[-2] if len(plans) > 1 and rng.random() < 0.3 else plans[-1]).copy()
            for c in rng.choice(p.n_calls, size=min(p.n_calls, int(rng.integers(1, 3))), replace=False):
                plan[c] = rng.integers(0, len(p.candidates[c]))
            plans.append(plan)
        walk = cpp.evaluate_batch(np.stack(plans))  # one evaluator for the whole walk
        for i, plan in enumerate(plans):
            want = reference.evaluate(p, plan)
            assert cpp.evaluate(plan) == want
            assert (walk["time"][i], walk["cost"][i], walk["peak_memory"][i], walk["feasible"][i]) == \
                (want["time"], want["cost"], want["peak_memory"], want["feasible"])
            n_plans += 1
    assert n_merged > 300 and n_plans == 1200


def test_iterations_chain_when_every_node_reaches_the_next_iteration():
    # gen -> train with the parameter-version edge train(t) -> gen(t+1): every node precedes the next iteration
    p = _one_device_problem([1.0, 2.0], data=[(0, 1)], carry=[(1, 0)])
    assert p.to_cpp().iterations_chain
    # without it nothing of iteration t precedes iteration t + 1
    assert not _one_device_problem([1.0, 2.0], data=[(0, 1)], carry=[]).to_cpp().iterations_chain


def test_recompute_twins_must_pair_candidates_of_one_layout():
    p = random_problem(np.random.default_rng(1))
    c = next(c for c, k in enumerate(p.candidates) if (k.twin >= 0).any())
    k = p.candidates[c]
    i = int(np.nonzero(k.twin >= 0)[0][0])
    twin = k.twin.copy()
    twin[i] = i  # a candidate cannot be its own twin
    bad = dataclasses.replace(p, candidates=p.candidates[:c] + (dataclasses.replace(k, twin=twin),)
                              + p.candidates[c + 1:])
    with pytest.raises(ValueError, match="twin must pair two candidates of the same layout"):
        bad.to_cpp()
    # restricting the candidates drops a twin whose partner is left out
    kept = k.take([i])
    assert kept.twin.tolist() == [-1] and k.take([i, int(k.twin[i])]).twin.tolist() == [1, 0]


def _one_device_problem(times: list[float], data: list[tuple[int, int]], carry: list[tuple[int, int]],
                        n_devices: int = 2, meshes: list[tuple[int, int]] | None = None,
                        data_cost: float = 0.0, K: int = 4, **kw: float) -> SearchProblem:
    meshes = meshes or [(0, n_devices)] * len(times)
    cands = tuple(CandidateArrays(dev_lo=[lo], dev_hi=[hi], stage_width=[hi - lo], layout=[0], mesh_id=[0],
                                  shape_class=[0], time=[t], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0],
                                  mem_param=[0])
                  for t, (lo, hi) in zip(times, meshes))
    n = len(times)
    return SearchProblem(n_devices=n_devices, device_memory=GiB, call_names=tuple(f"c{i}" for i in range(n)),
                         call_model=tuple(range(n)), model_names=tuple(f"m{i}" for i in range(n)),
                         model_home=tuple(range(n)), candidates=cands, order_edges=(), carry_edges=tuple(carry),
                         data_edges=tuple(data), data_costs=tuple(PairCosts.dense(np.full((1, 1), data_cost)) for _ in data),
                         realloc_costs=tuple(PairCosts(1, 1) for _ in range(n)), n_iterations=K, **kw)


def test_colocated_chain_runs_sequentially():
    # Three dependent calls on the same mesh: an iteration is the sum of their times.
    p = _one_device_problem([1.0, 2.0, 4.0], data=[(0, 1), (1, 2)], carry=[(2, 0)])
    ev = p.to_cpp().evaluate(np.zeros(3, np.int32))
    assert ev["time"] == pytest.approx(7.0) and ev["makespan"] == pytest.approx(28.0)


def test_disjoint_meshes_overlap_across_iterations():
    # gen (2 s) on device 0 feeds train (3 s) on device 1; gen(t+1) does not wait for train(t)
    # (no carry edge), so in steady state the slower call sets the pace: 3 s per iteration.
    p = _one_device_problem([2.0, 3.0], data=[(0, 1)], carry=[], meshes=[(0, 1), (1, 2)], K=6)
    assert p.to_cpp().evaluate(np.zeros(2, np.int32))["time"] == pytest.approx(3.0)
    # With the parameter-version edge train(t) -> gen(t+1) the two serialize: 5 s.
    p = _one_device_problem([2.0, 3.0], data=[(0, 1)], carry=[(1, 0)], meshes=[(0, 1), (1, 2)], K=6)
    assert p.to_cpp().evaluate(np.zeros(2, np.int32))["time"] == pytest.approx(5.0)


def test_data_transfer_occupies_both_meshes():
    # A 0.5 s transfer between disjoint meshes adds to the critical path of a serial loop.
    p = _one_device_problem([2.0, 3.0], data=[(0, 1)], carry=[(1, 0)], meshes=[(0, 1), (1, 2)], data_cost=0.5)
    cpp = p.to_cpp()
    assert cpp.evaluate(np.zeros(2, np.int32))["time"] == pytest.approx(5.5)
    transfers = [r for r in cpp.schedule(np.zeros(2, np.int32)) if r[0] == 2]
    assert [(r[4], r[5]) for r in transfers[:2]] == [(2.0, 2.5), (7.5, 8.0)]


def test_dispatch_latency_delays_each_dependency_but_not_queued_work():
    # A serial loop of three calls: each waits 0.1 s for the master after the call it depends on.
    p = _one_device_problem([1.0, 2.0, 4.0], data=[(0, 1), (1, 2)], carry=[(2, 0)], dispatch_latency=0.1)
    assert p.to_cpp().evaluate(np.zeros(3, np.int32))["time"] == pytest.approx(7.3)
    assert reference.evaluate(p, np.zeros(3, np.int32))["time"] == pytest.approx(7.3)
    # Two independent calls on one device: the second was queued behind the first and follows it
    # at once; iteration t+1 waits 0.1 s after each.
    p = _one_device_problem([1.0, 2.0], data=[], carry=[(0, 0), (1, 1), (0, 1), (1, 0)], dispatch_latency=0.1)
    sched = p.to_cpp().schedule(np.zeros(2, np.int32))
    assert [(r[4], r[5]) for r in sched[:4]] == [(0.0, 1.0), (1.0, 3.0), (3.1, 4.1), (4.1, 6.1)]


def test_devices_sharing_cores_slow_each_other_down():
    # Calls of 2 s (device 0) and 1 s (device 1) on one host with one core: both run at half speed
    # until the short one ends at 2 s, then the long one has 1 s of work left: 3 s per iteration.
    kw = dict(data=[], carry=[(0, 0), (1, 1), (0, 1), (1, 0)], meshes=[(0, 1), (1, 2)])
    p = _one_device_problem([2.0, 1.0], devices_per_node=2, cores_per_node=1.0, **kw)
    cpp = p.to_cpp()
    assert cpp.evaluate(np.zeros(2, np.int32))["time"] == pytest.approx(3.0)
    assert [(r[4], r[5]) for r in cpp.schedule(np.zeros(2, np.int32))[:2]] == [(0.0, 3.0), (0.0, 2.0)]
    # As many cores as devices, or each device a host of its own: no contention, max(2, 1) = 2 s.
    for extra in (dict(devices_per_node=2, cores_per_node=2.0), dict(devices_per_node=1, cores_per_node=1.0)):
        assert _one_device_problem([2.0, 1.0], **extra, **kw).to_cpp().evaluate(np.zeros(2, np.int32))["time"] == 2.0
    # Four 1 s calls on four devices sharing two cores: each at half speed, all end at 2 s.
    p = _one_device_problem([1.0] * 4, data=[], carry=[(i, j) for i in range(4) for j in range(4)], n_devices=4,
                            meshes=[(i, i + 1) for i in range(4)], devices_per_node=4, cores_per_node=2.0)
    assert p.to_cpp().evaluate(np.zeros(4, np.int32))["time"] == pytest.approx(2.0)


def test_reallocation_node_between_train_and_generation():
    # Actor: train is the home (layout 0, pp=2 over devices 0-1), gen runs on layout 1 (dp=2).
    # Parameters follow the chain of calls, as the runtime moves them: train(t) -> realloc(0 -> 1)
    # -> gen(t+1) -> realloc(1 -> 0) -> train(t+1). An iteration is gen + train + both moves.
    cands = (
        CandidateArrays(dev_lo=[0], dev_hi=[2], stage_width=[2], layout=[1], mesh_id=[0], shape_class=[0],
                        time=[2.0], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0], mem_param=[5]),
        CandidateArrays(dev_lo=[0], dev_hi=[2], stage_width=[1], layout=[0], mesh_id=[0], shape_class=[0],
                        time=[3.0], mem_offset=[0, 2], mem_static=[10, 12], mem_dynamic=[1, 4], mem_param=[0, 0]),
    )
    realloc = PairCosts.dense(np.array([[0.0, 0.75], [0.5, 0.0]]))
    p = SearchProblem(n_devices=2, device_memory=100, call_names=("gen", "train"), call_model=(0, 0),
                      model_names=("actor",), model_home=(1,), candidates=cands, order_edges=(),
                      carry_edges=((1, 0),), data_edges=((0, 1),), data_costs=(PairCosts.dense(np.zeros((2, 2))),),
                      realloc_costs=(realloc,), n_iterations=4)
    cpp = p.to_cpp()
    ev = cpp.evaluate(np.zeros(2, np.int32))
    assert ev["time"] == pytest.approx(6.25) and ev["exact"]
    # Device 0: static 10 + max(train's 1, gen's copy 5) = 15; device 1: 12 + max(4, 5) = 17.
    assert ev["peak_memory"] == 17 and ev["peak_device"] == 1 and ev["peak_call"] == 0 and ev["feasible"]
    assert cpp.memory(np.zeros(2, np.int32))["device_peak"] == [15, 17]
    # An unpriced reallocation pair reads as the provisional cost and is reported missing.
    realloc.known.pop((0, 1))
    realloc.provisional = 0.25
    cpp = p.to_cpp()
    ev = cpp.evaluate(np.zeros(2, np.int32))
    assert ev["time"] == pytest.approx(5.75) and not ev["exact"]
    assert cpp.missing(np.zeros(2, np.int32)).tolist() == [[0, 0, 1]]


def test_a_finished_calls_outputs_are_sent_before_what_its_end_unblocks():
    # P (device 0) feeds C1 on device 0 (no transfer) and C2 on device 1 (0.5 s transfer). Both C1
    # and the transfer become ready 0.1 s after P ends; the master sends P's outputs on first, so
    # C2 does not wait for C1's 5 s.
    cands = tuple(CandidateArrays(dev_lo=[lo], dev_hi=[lo + 1], stage_width=[1], layout=[0], mesh_id=[lo],
                                  shape_class=[0], time=[t], mem_offset=[0, 1], mem_static=[0], mem_dynamic=[0],
                                  mem_param=[0])
                  for t, lo in ((1.0, 0), (5.0, 0), (2.0, 1)))
    p = SearchProblem(n_devices=2, device_memory=GiB, call_names=("p", "c1", "c2"), call_model=(0, 1, 2),
                      model_names=("a", "b", "c"), model_home=(0, 1, 2), candidates=cands, order_edges=(),
                      carry_edges=((1, 0), (2, 0)), data_edges=((0, 1), (0, 2)),
                      data_costs=(PairCosts.dense(np.zeros((1, 1))), PairCosts.dense(np.full((1, 1), 0.5))),
                      realloc_costs=tuple(PairCosts(1, 1) for _ in range(3)), n_iterations=3, dispatch_latency=0.1)
    plan = np.zeros(3, np.int32)
    spans = {(r[0], r[1]): (r[4], r[5]) for r in p.to_cpp().schedule(plan) if r[3] == 0}
    assert spans[2, 2] == pytest.approx((1.1, 1.6))  # the transfer to c2
    assert spans[0, 1] == pytest.approx((1.6, 6.6)) and spans[0, 2] == pytest.approx((1.6, 3.6))
    assert [(r["start"], r["end"]) for r in reference.schedule(p, plan)] == \
        [(r[4], r[5]) for r in p.to_cpp().schedule(plan)]
