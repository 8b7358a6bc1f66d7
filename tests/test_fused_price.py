"""A fused train pair is priced on the rows the unfused calls are priced on (estimator/fused_cost.py,
``CostModel.train_passes``; docs/fused-training.md, "Where a fused step's time goes").

With varying response lengths a train call runs packed rows (``Workload.packed``), and ``call_cost`` prices it
there. The fused schedule's passes were priced at padded rows (every sequence prompt + gen_len long): on the
``long`` setting (lognormal median 4, p99 128) each pass 2-3x too long, so the bubbles fusion fills, and the saving
taken off the serial price, several times too large (the fused pair at 0.134 s against 0.29 s measured).
"""

import dataclasses

import pytest

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.estimator.fused_cost import price_fused_pair
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.lengths import ResponseLengths

PAIR = ("actor_train", "critic_train")


def priced(lengths: ResponseLengths | None, n_mbs: int):
    base = load_experiment("experiments/ppo_tiny.py")
    extra = {} if lengths is None else {"response_lengths": lengths}
    graph = build_graph(dataclasses.replace(base, batch_size=128, gen_len=128, **extra))
    cost = CostModel(graph)
    plan = ExecutionPlan.by_hand(graph, {c: ("localhost", 1, 1, 2, n_mbs) for c in graph.spec.call_names},
                                 fused=[PAIR])
    return graph, cost, plan, price_fused_pair(cost, plan, *PAIR)


@pytest.mark.parametrize("n_mbs", [2, 8])
def test_long_tailed_passes_are_the_packed_rows(n_mbs):
    graph, cost, plan, r = priced(ResponseLengths.lognormal(4, 128), n_mbs)
    mesh = graph.spec.cluster.mesh("localhost")
    for k, call in enumerate(PAIR):
        p, work = plan.placements[call], cost.workload(call)
        b = work.micro_batch(1, n_mbs)  # sequences per micro-batch at dp 1
        rows, width = work.packed(b)
        # the long tail packs: fewer rows than sequences, each narrower than a padded one (not a vacuous check)
        assert rows < b and width < work.seq_len
        timer = cost._timer(graph.model_config(call), cost._precisions[call])
        want = timer.train_stage_passes(p.strategy, cost.links(mesh, p.strategy), rows, width)
        padded = timer.train_stage_passes(p.strategy, cost.links(mesh, p.strategy), b, work.seq_len)
        fwd, bwd, _ = cost.train_passes(call, mesh, p.strategy, n_mbs)
        assert (fwd, bwd) == (want[0], want[1])
        assert sum(fwd) + sum(bwd) < 0.5 * (sum(padded[0]) + sum(padded[1]))
        # the unfused price of one optimizer step holds the call's 1F1B pipeline over those passes, so the
        # pipeline alone cannot exceed it (with padded passes it was 4x the whole step's price)
        per_step = cost.call_cost(call, mesh, p.strategy, n_mbs).time / r.n_steps
        assert r.schedule.alone[k] < per_step
    # hand-computed: a stage group runs n_mbs forwards and backwards of the first call's stage k and of the second
    # call's stage pp - 1 - k (reverse order), so the fused makespan is at least the busiest group's passes, and
    # fusion saves at most the two 1F1B pipelines alone less that, per optimizer step
    (f0, b0, _), (f1, b1, _) = (cost.train_passes(c, mesh, plan.placements[c].strategy, n_mbs) for c in PAIR)
    busiest = max(n_mbs * (f0[k] + b0[k] + f1[1 - k] + b1[1 - k]) for k in (0, 1))
    assert 0.0 < r.serial_time - r.time <= r.n_steps * (sum(r.schedule.alone) - busiest) + 1e-12

def test_fixed_lengths_price_as_before():
    graph, cost, plan, r = priced(None, 8)
    mesh = graph.spec.cluster.mesh("localhost")
    for call in PAIR:
        p, work = plan.placements[call], cost.workload(call)
        timer = cost._timer(graph.model_config(call), cost._precisions[call])
        padded = timer.train_stage_passes(p.strategy, cost.links(mesh, p.strategy), work.micro_batch(1, 8),
                                            work.seq_len)
        assert cost.train_passes(call, mesh, p.strategy, 8)[:2] == padded
