"""The roofline estimator against the paper's measured 7B+7B call times (benchmarks/bench_estimator_calibration.py
prints the full table; this test holds its gate): every call of realhf-appendix.txt Table 5's heuristic plan
within +-30% of the paper's seconds, generation against the CUDAGraph column."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.strategy import ParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_estimator_calibration import HEURISTIC, TOLERANCE, realhf_micro_batches  # noqa: E402


@pytest.fixture(scope="module")
def model() -> CostModel:
    return CostModel(build_graph(load_experiment("experiments/ppo_7b_7b.py")))


@pytest.mark.parametrize("call", sorted(HEURISTIC))
def test_heuristic_call_time_within_30_percent_of_the_paper(model, call):
    mesh, tp, pp, dp, mbs, paper = HEURISTIC[call]
    mbs = realhf_micro_batches(model.graph.call(call).interface_type.value, pp, mbs)
    t = model.call_cost(call, model.cluster.mesh(mesh), ParallelStrategy(dp, tp, pp), mbs).time
    assert abs(t / paper - 1) <= TOLERANCE, (call, t, paper)
