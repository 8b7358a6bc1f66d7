"""Response-length distributions in the workload (issue 31, item 1): the distributions, the estimator's
pricing of generation over the rows still running and of packed inference and training, the simulators'
agreement on problems priced with them, and ``realloc search --lengths-from``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from realloc.api import GENERATE, ModelFunctionCallDef, auto, experiment_spec, load_experiment
from realloc.cli import main
from realloc.estimator.call_time import decode_segments
from realloc.estimator.cost import CostModel
from realloc.estimator.opcount import Phase
from realloc.graph.dataflow import build_graph
from realloc.lengths import SAMPLES_FILE, ResponseLengths, lengths_from_run
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.strategy import ParallelStrategy as S
from spec_helpers import COST_ONLY_INTERFACES

R = ResponseLengths


# -- the distributions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("make, words", [
    (lambda: R("beta"), "unknown kind"),
    (lambda: R.uniform(0, 4), "low must be a positive integer"),
    (lambda: R.uniform(5, 4), "must not exceed high"),
    (lambda: R.uniform(2.5, 4), "low must be a positive integer"),
    (lambda: R.lognormal(0.5, 10), "median must be a finite number >= 1"),
    (lambda: R.lognormal(10, float("inf")), "p99 must be a finite number"),
    (lambda: R.lognormal(10, 10), "p99 (10) must exceed the median"),
    (lambda: R.empirical([]), "at least one observed length"),
    (lambda: R.empirical([3, 0]), "positive integers, got 0"),
    (lambda: R.empirical({4: -1}), "count of length 4"),
])
def test_bad_distributions_are_one_clear_error(make, words):
    with pytest.raises(ValueError, match="response_lengths") as e:
        make()
    assert words in str(e.value)


def test_auto_checks_the_distribution_against_gen_len():
    with pytest.raises(ValueError, match=r"uniform high \(9\) exceeds gen_len \(8\)"):
        auto("localhost", 4, gen_len=8, response_lengths=R.uniform(1, 9))
    with pytest.raises(ValueError, match="must be a ResponseLengths"):
        auto("localhost", 4, gen_len=8, response_lengths="lognormal")


def test_probabilities_means_and_quantiles_by_hand():
    p = R.uniform(3, 6).pmf(8)
    assert p.tolist() == [0, 0, 0, 0.25, 0.25, 0.25, 0.25, 0, 0]
    assert R.uniform(3, 6).mean(8) == pytest.approx(4.5)
    assert R.fixed().pmf(4).tolist() == [0, 0, 0, 0, 1]
    # observed lengths above gen_len were cut there
    assert R.empirical([2, 2, 3, 12]).pmf(5).tolist() == [0, 0, 0.5, 0.25, 0, 0.25]
    d = R.lognormal(40, 480)
    assert d.pmf(1000).sum() == pytest.approx(1.0)
    assert d.quantile(0.5, 1000) == 40 and d.quantile(0.99, 1000) == 480
    # mean of a lognormal: median * exp(sigma^2 / 2)
    sigma = math.log(480 / 40) / 2.3263478740408408
    assert d.mean(100000) == pytest.approx(40 * math.exp(sigma**2 / 2), rel=2e-3)


@pytest.mark.parametrize("dist, g, b", [(R.uniform(1, 4), 4, 3), (R.empirical({1: 5, 3: 1, 7: 2}), 8, 4),
                                        (R.lognormal(2, 7), 9, 3)])
def test_order_statistics_are_the_expected_sorted_lengths_by_enumeration(dist, g, b):
    p = dist.pmf(g)
    support = [k for k in range(g + 1) if p[k] > 0]
    want = np.zeros(b)
    for draw in itertools.product(support, repeat=b):
        want += np.sort(draw) * np.prod([p[k] for k in draw])
    assert dist.order_statistics(g, b) == tuple(int(math.floor(x + 0.5)) for x in want)


def test_decode_segments_run_each_step_with_the_rows_still_going():
    assert decode_segments((3, 3, 5, 8)) == [(1, 2, 4), (3, 4, 2), (5, 7, 1)]
    assert decode_segments((1, 1)) == []
    ends = tuple(range(2, 42))  # 40 runs of one step each, merged into 4 groups of 10
    merged = decode_segments(ends, 4)
    assert [(lo, hi) for lo, hi, _ in merged] == [(1, 10), (11, 20), (21, 30), (31, 40)]
    exact = decode_segments(ends, 1000)
    for lo, hi, rows in merged:  # the rows x steps of each group, up to rounding
        assert rows == round(sum(r for a, _, r in exact if lo <= a <= hi) / (hi - lo + 1))


# -- the estimator ----------------------------------------------------------------------------------------
@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class GenOnly:
    @property
    def rpcs(self):
        return [ModelFunctionCallDef(name="gen", model_name="actor", model_type="tiny", interface_type=GENERATE,
                                     interface_impl="gen_seq", input_data=["prompts"], output_data=["seq"])]

    interfaces = COST_ONLY_INTERFACES


def _with(spec, lengths):
    return dataclasses.replace(spec, response_lengths=lengths)


@pytest.mark.parametrize("s, n_mbs", [(S(1, 1, 1), 1), (S(1, 1, 2), 2), (S(2, 1, 1), 2)])
def test_generation_decodes_only_the_rows_still_running(s, n_mbs):
    spec = _with(experiment_spec(GenOnly), R.empirical({3: 2, 10: 1, 24: 1}))
    model = CostModel(build_graph(spec), discover=False)
    mesh = next(m for m in model.cluster.device_meshes() if m.size == s.world_size)
    cost = model.call_cost("gen", mesh, s, n_mbs)
    timer, links, w = model._timer(model.graph.model_config("gen")), model.links(mesh, s), model.workload("gen")
    b = w.micro_batch(s.dp, n_mbs)
    ends = spec.response_lengths.order_statistics(w.gen_len, b)
    # the call ends with the micro-batch (dp rank) that holds its longest row: of all n rows (issue 31 item 1)
    ends = ends[:-1] + (max(ends[-1], spec.response_lengths.order_statistics(w.gen_len, w.n_seqs)[-1]),)
    assert len(set(ends)) > 1
    h = model.hw.decode_step_overhead

    def stage_totals(phase, rows, ctx):
        return [st.compute + st.tp_comm + st.pp_comm + h for st in timer._stages(phase, s, links, rows, ctx)]

    pre = stage_totals(Phase.PREFILL, b, w.prompt_len)
    want = sum(pre) + (n_mbs - 1) * max(pre)
    for j in range(1, max(ends)):  # decode step j: the rows whose response is longer than j tokens
        rows = sum(e > j for e in ends)
        st = stage_totals(Phase.DECODE, rows, w.prompt_len + j)
        back = model.comm.time("p2p", 2, 16 * rows, links.pp_any) if s.pp > 1 else 0.0
        want += max(n_mbs * max(st), sum(st) + back)
    assert cost.time == pytest.approx(want + model.hw.call_overhead, rel=1e-9)
    fixed = CostModel(build_graph(_with(spec, R.fixed())), discover=False).call_cost("gen", mesh, s, n_mbs)
    assert cost.time < fixed.time


def test_inference_and_training_run_the_packed_tokens():
    spec = _with(load_experiment("experiments/ppo_tiny.py"), R.empirical({1: 3, 8: 1}))
    w = CostModel(build_graph(spec), discover=False).workload("ref_inf")
    # 4 rows: the longest of 4 is expected at 1 + (1 - 0.75^4) * 7 = 5.79, so rows of 8 + 6 = 14 tokens; the other
    # three expected lengths round to 1 (9-token sequences), no two of which fit a row of 14: 4 rows. 16 rows: the
    # expected order statistics are 1 (nine times), 2, 2, 4, 5, 7, 8, 8: sequences of 9 to 16 tokens in rows of 16,
    # and first-fit decreasing (the engine's packing) puts no two in a row: 16 rows, no packing at all (the
    # tokens / width rule said 11)
    assert w.packed(4) == (4, 14)
    assert w.packed(16) == (16, 16)
    fixed = dataclasses.replace(w, lengths=R.fixed())
    assert fixed.packed(16) == (16, 16)


SHIPPED = ["experiments/ppo_tiny.py", "experiments/grpo_tiny.py", "experiments/ppo_7b_7b.py",
           "experiments/dpo_tiny.py"]


@pytest.mark.parametrize("path", SHIPPED)
def test_fixed_lengths_price_every_candidate_as_before(path):
    """The shipped experiments declare no lengths (fixed); a distribution that puts every response at gen_len
    runs the new code paths (decode segments, packing) and must price every candidate bit for bit the same."""
    spec = load_experiment(path)
    assert spec.response_lengths == R.fixed()
    same = _with(spec, R.uniform(spec.gen_len, spec.gen_len))
    a = PlanSpace.build(build_graph(spec), max_n_mbs=4)
    b = PlanSpace.build(build_graph(same), max_n_mbs=4)
    for x, y in zip(a.problem.candidates, b.problem.candidates):
        assert x.time.tolist() == y.time.tolist()
        assert x.mem_dynamic.tolist() == y.mem_dynamic.tolist()


def _random_lengths(rng: np.random.Generator, g: int) -> ResponseLengths:
    kind = rng.integers(4)
    if kind == 0:
        return R.fixed()
    if kind == 1:
        lo = int(rng.integers(1, g + 1))
        return R.uniform(lo, int(rng.integers(lo, g + 1)))
    if kind == 2:
        median = float(rng.uniform(1, g))
        return R.lognormal(median, median * float(rng.uniform(1.5, 20)))
    return R.empirical(rng.integers(1, 2 * g, size=int(rng.integers(1, 30))).tolist())


def test_simulators_agree_on_problems_priced_with_random_length_distributions():
    """The C++ simulator against the Python reference (tests/test_simulator.py does it on random arrays), on
    problems whose call times the estimator priced under random response-length distributions."""
    rng = np.random.default_rng(31)
    base = load_experiment("experiments/ppo_tiny.py")
    times = set()
    for trial in range(6):
        g = int(rng.integers(2, 40))
        spec = dataclasses.replace(base, gen_len=g, response_lengths=_random_lengths(rng, g))
        space = PlanSpace.build(build_graph(spec), max_n_mbs=4)
        space.price_all_pairs()
        cpp = space.problem.to_cpp()
        for _ in range(8):
            plan = np.array([rng.integers(0, len(k)) for k in space.problem.candidates], np.int32)
            got, want = cpp.evaluate(plan), reference.evaluate(space.problem, plan)
            assert got == want, (trial, spec.response_lengths, plan)
            times.add(want["time"])
    assert len(times) > 20


# -- realloc search --lengths-from ------------------------------------------------------------------------
def _write_samples(run, lengths):
    run.mkdir()
    with (run / SAMPLES_FILE).open("w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"iteration": 1, "seq": i, "response_ids": [5] * n, "logp": [-1.0] * n}) + "\n")
        f.write(json.dumps({"iteration": 1, "seq": 0, "key": "greedy_seq", "logp": [-1.0] * 3}) + "\n")


def test_lengths_from_a_runs_samples(tmp_path):
    _write_samples(tmp_path / "run", [2, 5, 5, 7])
    assert lengths_from_run(tmp_path / "run") == R.empirical({2: 1, 3: 1, 5: 2, 7: 1})
    from realloc.runtime.records.text_io import SAMPLES_FILE as written

    assert written == SAMPLES_FILE
    with pytest.raises(ValueError, match="no such run directory"):
        lengths_from_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no samples.jsonl"):
        lengths_from_run(tmp_path / "empty")


def test_search_prices_the_lengths_of_an_earlier_run(tmp_path, capsys):
    _write_samples(tmp_path / "run", [1, 1, 2, 3, 8])
    assert main(["search", "experiments/ppo_tiny.py", "--evals", "500", "--threads", "1",
                 "--lengths-from", str(tmp_path / "run")]) == 0
    assert "response lengths empirical (6 responses, 1-8 tokens), mean 3.0 of at most 8" in capsys.readouterr().out
    assert main(["search", "experiments/ppo_tiny.py", "--evals", "10", "--lengths-from", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such run directory" in err
