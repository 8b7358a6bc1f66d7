"""Issue 31 on ``bench_fusion.py --setting long`` (128 rows of 32-token prompts, responses lognormal median 4, p99
128): packed rows priced as the engine packs them (estimator/packed_rows.py), against the engine's own packing of
the lengths the seeded schedule draws, and the schedule of the disaggregated plan that both simulators reproduce."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

from realloc.estimator.packed_rows import ffd_row_count, packed_shape
from realloc.estimator.tail_cost import split_ends
from realloc.lengths import ResponseLengths as R
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.packing import first_fit_decreasing, pack_layout
from realloc.models.weights import param_seed

LONG = R.lognormal(median=4, p99=128)
PROMPT, GEN, ROWS = 32, 128, 128


def _drawn(iterations: int = 8) -> list[list[int]]:
    """Each iteration's sequence lengths (prompt + response) as the runs' length schedule draws them
    (``generation.py``: seed ``generate/<t>``, the batch's sequence ids)."""
    return [[PROMPT + n for n in scheduled_lengths(LONG, GEN, param_seed(1, f"generate/{t}"), range(ROWS))]
            for t in range(iterations)]


def _engine_slots(lengths: list[int]) -> int:
    """Token slots of one micro-batch packed by the engine (rows x the longest)."""
    return len(first_fit_decreasing(lengths, max(lengths))) * max(lengths)


def test_the_row_count_is_the_engines_first_fit_decreasing():
    rng = random.Random(3)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        cap = max(lengths) + rng.choice([0, 0, 7])
        assert ffd_row_count(lengths, cap) == len(first_fit_decreasing(lengths, cap))
    # and the engine's packed layout of a right-padded batch has that many rows
    import torch

    from realloc.models.batch import TokenLayout

    lengths = [9, 3, 12, 5, 5, 2, 11, 4]
    ids = torch.zeros(len(lengths), 12, dtype=torch.long)
    seg = torch.tensor([[0 if j < n else -1 for j in range(12)] for n in lengths])
    pos = torch.arange(12).expand(len(lengths), 12).clone()
    plan = pack_layout(TokenLayout(ids, pos, seg))
    assert plan.layout.shape == (ffd_row_count(lengths, 12), 12) == (5, 12)  # 12 | 11 | 9+3 | 5+5+2 | 4


@pytest.mark.parametrize("b", [16, 32, 64, 128])
def test_packed_micro_batches_take_the_slots_the_engine_packs(b):
    """A micro-batch of b rows of the long setting: the estimate's rows x width within 5% of the mean token slots
    of the engine's packing of the drawn lengths (contiguous micro-batches of 8 iterations); tokens / width, the
    rule before, was 9-14% short at 32 to 128 rows (1392 slots against 1616 at 32)."""
    measured = statistics.mean(_engine_slots(ls[a:a + b]) for ls in _drawn() for a in range(0, ROWS - b + 1, b))
    rows, width = packed_shape(LONG, PROMPT, GEN, b)
    assert rows * width == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("tail", [13, 26])
def test_a_migrated_tail_packs_its_long_rows_apart(tail):
    """A consumer's second part on a migrated tail (the R_t longest rows, ``tail_cost.part_workload``'s lengths):
    within 5% of the engine's packing of each iteration's R_t longest drawn rows; they rarely share a row."""
    measured = statistics.mean(_engine_slots(sorted(ls)[-tail:]) for ls in _drawn())
    _, ends = split_ends(LONG, GEN, ROWS, tail)
    rows, width = packed_shape(R.empirical(ends), PROMPT, GEN, tail)
    assert rows * width == pytest.approx(measured, rel=0.05)
    assert rows > -(-sum(PROMPT + e for e in ends) // width)  # more rows than the tokens fill


def test_the_disaggregated_plans_schedule_in_both_simulators(tmp_path):
    """The long setting's disaggregated plan (generation on device 0, the three inference calls on device 1, the
    train calls over both): both simulators give the same schedule; on device 1 the inference calls run one after
    the other in the order the master dispatches them (the graph's), each for its priced time, none before the
    generation ends."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_fusion import write_experiment

    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from realloc.search import reference
    from realloc.search.timeline import estimate_plan

    exp = tmp_path / "long.py"
    write_experiment(exp, "rm", ROWS, GEN, "tiny", "tiny-critic", balance_tokens=True, median=4, prompt=PROMPT)
    graph = build_graph(load_experiment(str(exp)))
    both, dev0, dev1 = ("localhost", 2, 1, 1, 1), ("localhost:0", 1, 1, 1, 1), ("localhost:1", 1, 1, 1, 1)
    inference = ("rew_inf", "ref_inf", "critic_inf")
    plan = ExecutionPlan.by_hand(graph, {c: dev0 if c == "actor_gen" else dev1 if c in inference else both
                                         for c in graph.spec.call_names}, source="hand")
    cost = CostModel(graph, discover=False)
    space, idx = estimate_plan(graph, plan, cost)
    p = space.problem
    got = [tuple(r[:6]) for r in space.cpp.schedule(idx)]
    want = [(r["kind"], r["call"], r["other"], r["iteration"], r["start"], r["end"])
            for r in reference.schedule(p, idx)]
    assert got == want
    mid = p.n_iterations // 2
    calls = {p.call_names[r[1]]: (r[4], r[5]) for r in got if r[0] == 0 and r[3] == mid}
    mesh = graph.spec.cluster.mesh("localhost:1")
    from realloc.strategy import ParallelStrategy

    order = [c for c in graph.topo_order if c in inference]
    assert calls[order[0]][0] >= calls["actor_gen"][1]
    for a, b in zip(order, order[1:]):
        assert calls[b][0] >= calls[a][1]  # one device: one call at a time
    for c in inference:
        priced = cost.call_cost(c, mesh, ParallelStrategy(1, 1, 1), 1).time
        assert calls[c][1] - calls[c][0] == pytest.approx(priced, rel=1e-9)
