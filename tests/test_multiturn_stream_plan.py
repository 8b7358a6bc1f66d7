"""Streaming a multi-turn call's finished rollouts as a plan choice (issue 34 item 3; estimator/turn_stream_cost.py):
priced by turns from the turn profile against a hand computation, both plan simulators agree on every streamed
row of the space, the search offers it (and never a migration), `realloc show` takes a hand-written plan with it
and refuses a migration in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from realloc.estimator.chunk_cost import _request
from realloc.estimator.cost import CostModel
from realloc.estimator.tail_cost import COUNT_BYTES, consumer_parts
from realloc.estimator.turn_stream_cost import running_after, split_turns, turn_lead_shares, turn_stream_cost
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.graph.tail import TailMigration
from realloc.search import reference
from realloc.search.build import PlanSpace
from realloc.strategy import ParallelStrategy

# 32 rollouts; half stop after turn 1, a quarter after turn 2, the rest take all 3
EXPERIMENT = '''
import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto

ENV = {"env": "tools", "env_args": {"tools": ["calculator"]}, "max_turns": 3, "turn_tokens": 8,
       "turn_profile": {"policy_tokens": [8, 8, 8], "observation_tokens": [4, 4], "reach": [1.0, 0.5, 0.25],
                        "step_s": 0.05, "final_s": 0.01}}


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=40)
@dataclasses.dataclass
class MultiTurnPlan:
    dataset: str = "REPO/experiments/data/calc_train.jsonl"
    tokenizer: str = "REPO/experiments/data/calc_tokenizer"
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2)

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=8)
'''
# generation on device 0, the reference on device 1 (it streams), the train step over both
PLACES = {"actor_gen": ("localhost:0", 1, 1, 1, 1), "ref_inf": ("localhost:1", 1, 1, 1, 1),
          "actor_train": ("localhost", 2, 1, 1, 1)}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    from run_helpers import REPO

    path = tmp_path_factory.mktemp("mt") / "multiturn_plan.py"
    path.write_text(EXPERIMENT.replace("REPO", str(REPO)))
    return path


@pytest.fixture(scope="module")
def graph(experiment):
    from realloc.api import load_experiment

    return build_graph(load_experiment(str(experiment)))


def test_turn_split_points_and_pricing_by_hand(graph):
    """After turns 1, 2, 3: 16, 8, 0 of 32 rollouts run. R = 8 in 2 chunks (thresholds 20 and 8) splits after
    turns 1 and 2; phase 1 is the dispatch, those turns, a count per turn and one request for the earlier split
    point; phase 2 the rest of the plain call and one request; the lead the turn-2 time and a request."""
    cost = CostModel(graph, discover=False)
    mesh = next(m for m in cost.cluster.device_meshes() if m.size == 1)
    strategy = ParallelStrategy(1, 1, 1)
    assert running_after(cost, "actor_gen") == (16, 8, 0)
    assert split_turns((16, 8, 0), 32, 8, 2) == (1, 2)
    assert split_turns((16, 8, 0), 32, 4, 1) == (3,)  # no turn leaves 1..4 running: the split is the call's end
    turns = cost.turns("actor_gen", mesh, strategy, 1)
    assert [t.rows for t in turns] == [32, 16, 8]
    hw, req = cost.hw, _request(cost, mesh)
    count = cost.comm.time("all_reduce", 1, COUNT_BYTES, cost.links(mesh, strategy).dp)
    plain = cost.call_cost("actor_gen", mesh, strategy, 1).time
    tc, lead, running = turn_stream_cost(cost, "actor_gen", mesh, strategy, 1, 8, 2)
    t1 = hw.call_overhead + turns[0].time + count
    t2 = hw.call_overhead + turns[0].time + turns[1].time + 2 * count + req
    assert running == (16, 8)
    assert tc.phase1 == pytest.approx(t2) and lead == pytest.approx(t2 - t1)
    assert tc.phase2 == pytest.approx(plain - (t2 - req) + hw.call_overhead)
    assert turn_lead_shares((16, 8, 0), 32, 8, 2, 1) == (1.0,)
    assert turn_lead_shares((16, 8, 0), 32, 8, 2, 2) == (0.5,)
    # the consumer's parts: the 24 rollouts finished by turn 2, then the 8 still running
    assert consumer_parts(cost, "ref_inf", "actor_gen", mesh, strategy, 1, 8)[0] > 0


def _space(graph):
    def keep(call: str, o) -> bool:
        mesh, dp = PLACES[call][0], PLACES[call][1]
        return o.mesh.name == mesh and o.strategy.dp == dp and o.strategy.pp == 1
    return PlanSpace.build(graph, CostModel(graph, discover=False), option_filter=keep, max_n_mbs=1)


def test_the_space_offers_streams_only_and_both_simulators_agree(graph):
    """Every stream row of the multi-turn generation (R from the grid, 1, 2 or 4 chunks) round-trips through the
    space, C++ and Python simulate it alike, and no row migrates; the MCMC's pick is the best by exhaustive
    pricing, and streaming beats the plain plan here (the reference on device 1 starts on finished rollouts)."""
    from types import SimpleNamespace

    from realloc.search.engine import run_mcmc
    from realloc.search.tail_report import tail_summary

    space = _space(graph)
    tails = [t for t in space.tails[space.problem.call_names.index("actor_gen")] if t is not None]
    assert tails and all(t.migration.instances == 0 for t in tails)
    assert {t.migration.chunks for t in tails} == {1, 2, 4}
    base = ExecutionPlan.by_hand(graph, PLACES)
    priced = {None: space.evaluate(space.indices_of(base))["time"]}
    for t in tails:
        idx = space.indices_of(base.model_copy(update={"tail": {"actor_gen": t.migration}}))
        assert space.to_plan(idx, "x").tail == {"actor_gen": t.migration}
        assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
        priced[t.migration] = space.evaluate(idx)["time"]
    rng = np.random.default_rng(34)
    for _ in range(50):  # random plans over the whole restricted space
        idx = np.array([rng.integers(len(k)) for k in space.problem.candidates], np.int32)
        assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
    best = min(priced.values())
    assert best < priced[None]
    out = run_mcmc(space, max_evals=6000, time_limit=None, n_threads=1)
    plan = space.to_plan(out.indices, "search")
    assert plan.estimated_time == pytest.approx(best)
    report = SimpleNamespace(no_tail=space.to_plan(space.indices_of(base), "x"), space=space, plan=plan,
                             indices=out.indices, graph=graph)
    assert tail_summary(report)[0].startswith("streaming: actor_gen hands its finished rollouts on")


def test_show_takes_a_streamed_multiturn_plan_and_refuses_a_migration(experiment, graph, tmp_path, capsys):
    from realloc.cli import main
    from realloc.graph.streaming import check_runtime_tail

    streamed = ExecutionPlan.by_hand(graph, PLACES, tail={"actor_gen": (8, 0, 2)})
    check_runtime_tail(streamed, graph)
    path = tmp_path / "streamed.json"
    streamed.save(path)
    assert main(["show", str(experiment), "--plan", str(path)]) == 0
    assert f"plan       {path}: valid" in capsys.readouterr().out
    both = dict(PLACES, actor_gen=("localhost", 2, 1, 1, 1), ref_inf=("localhost", 2, 1, 1, 1))
    migrating = ExecutionPlan.by_hand(graph, both, tail={"actor_gen": TailMigration(rows=8, instances=1)})
    migrating.save(path)
    assert main(["show", str(experiment), "--plan", str(path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unfinished rollouts cannot migrate" in err[0] and "instances=0" in err[0], err
    # the turn loop streams at pp 1 only, and never micro-batch by micro-batch
    pp2 = dict(PLACES, actor_gen=("localhost", 1, 1, 2, 2))
    with pytest.raises(ValueError, match="entry 'actor_gen': interface .* turn by turn, .* pp 1 only"):
        check_runtime_tail(ExecutionPlan.by_hand(graph, pp2, tail={"actor_gen": (8, 0)}), graph)
    by_mb = {"actor_gen": TailMigration(rows=8, instances=0, micro_batches=True)}
    with pytest.raises(ValueError, match="entry 'actor_gen': micro_batches .* turn by turn"):
        check_runtime_tail(ExecutionPlan.by_hand(graph, PLACES, tail=by_mb), graph)


def test_multiturn_without_varying_turns_offers_no_stream(graph, experiment):
    """Every rollout taking every turn (reach 1): nothing finishes early, the space has no stream row."""
    from realloc.api import load_experiment

    spec = load_experiment(str(experiment))
    gen = next(r for r in spec.rpcs if r.name == "actor_gen")
    args = dict(gen.interface_args, turn_profile=dict(gen.interface_args["turn_profile"], reach=[1.0, 1.0, 1.0]))
    rpcs = [dataclasses.replace(r, interface_args=args) if r.name == "actor_gen" else r for r in spec.rpcs]
    flat = build_graph(dataclasses.replace(spec, rpcs=rpcs)) if dataclasses.is_dataclass(spec) else None
    if flat is None:
        pytest.skip("the experiment spec is not a dataclass")
    assert not _space(flat).tails
