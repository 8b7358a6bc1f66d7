"""A multi-turn rollout's later turn prefills after its kept KV cache (estimator/kept_prefill.py): the prefill's
attention over the kept keys is priced, against a hand computation from the attention's FLOPs and bytes (the
roofline) and from a measured table's growth with length; a multi-turn call's turn 2 carries it, and both plan
simulators price the plans alike."""

from __future__ import annotations

import numpy as np
import pytest

from realloc.api import load_experiment
from realloc.estimator import call_time
from realloc.estimator.call_time import CallTimer
from realloc.estimator.cost import CostModel
from realloc.estimator.kept_prefill import kept_attention_s
from realloc.estimator.opcount import Part, Phase
from realloc.estimator.roofline import RooflineCosts
from realloc.graph.dataflow import build_graph
from realloc.strategy import ParallelStrategy as S


@pytest.fixture(scope="module")
def model():
    return CostModel(build_graph(load_experiment("experiments/ppo_tiny.py")))  # the shipped tiny profile


def roofline_attention(cfg, hw, tp: int, b: int, s: int, attended: float, read: int) -> float:
    """One block's fused attention on the roofline, written out: QK^T and PV are 2 MACs per (query, key, q
    channel), 2 FLOPs a MAC; the kernel reads q and writes o (s tokens x q channels each) and reads every attended
    key and value once per row (k and v, kv channels each, of the rank's heads); 4-byte fp32 elements."""
    q, kv = cfg.n_heads * cfg.head_dim / tp, cfg.local_kv_heads(tp) * cfg.head_dim
    flops = 4.0 * b * s * attended * q
    nbytes = (b * s * 2 * q + b * read * 2 * kv) * 4
    return max(flops / (hw.peak_flops * hw.compute_efficiency), nbytes / (hw.memory_bandwidth * hw.memory_efficiency))


def test_the_roofline_prices_the_attention_over_the_kept_keys_by_hand(model):
    cfg = model.graph.model_config("actor_gen")
    timer = CallTimer(cfg, RooflineCosts(cfg, model.hw, model.comm), model.comm, model.hw)
    b, s, kept = 8, 10, 29
    # the new tokens attend kept + (s + 1) / 2 positions on average (causal among themselves) against (s + 1) / 2
    want = (roofline_attention(cfg, model.hw, 1, b, s, kept + (s + 1) / 2, kept + s)
            - roofline_attention(cfg, model.hw, 1, b, s, (s + 1) / 2, s))
    assert want > 0 and kept_attention_s(timer, 1, b, s, kept) == pytest.approx(want, rel=1e-12)
    assert kept_attention_s(timer, 1, b, s, 0) == 0.0


class Scaled:
    """A "measured" table: the roofline's block prefill times ``k`` plus a fixed cost per op (launches), or a flat
    one that does not grow with length."""

    def __init__(self, roofline, k: float, fixed: float, flat: bool = False) -> None:
        self.roofline, self.k, self.fixed, self.flat, self.source = roofline, k, fixed, flat, "profile"

    def op(self, part, phase, tp, b, s):
        c, x = self.roofline.op(part, phase, tp, b, 1 if self.flat else s)
        return (self.fixed + self.k * c, x) if (part, phase) == (Part.BLOCK, Phase.PREFILL) else (c, x)

    def optimizer(self, n):
        return self.roofline.optimizer(n)

    def engine(self, *a):
        return None

    def interface(self, *a):
        return None


def test_a_measured_table_scales_it_by_its_growth_over_the_roofline_s(model):
    cfg = model.graph.model_config("actor_gen")
    roof = RooflineCosts(cfg, model.hw, model.comm)
    plain = kept_attention_s(CallTimer(cfg, roof, model.comm, model.hw), 1, 4, 9, 40)
    # the fixed per-op cost cancels in the table's growth from 9 to 49 tokens: 3x the roofline's attention
    assert kept_attention_s(CallTimer(cfg, Scaled(roof, 3.0, 2e-3), model.comm, model.hw), 1, 4, 9, 40) == \
        pytest.approx(3.0 * plain, rel=1e-9)
    # a table whose prefill does not grow with the prompt prices nothing for the kept keys
    assert kept_attention_s(CallTimer(cfg, Scaled(roof, 3.0, 2e-3, flat=True), model.comm, model.hw),
                            1, 4, 9, 40) == 0.0


def test_a_generation_after_kept_keys_adds_each_block_s_attention(model, monkeypatch):
    cfg = model.graph.model_config("actor_gen")
    costs = model.layer_costs(cfg)
    assert costs.source == "profile"
    timer = CallTimer(cfg, costs, model.comm, model.hw)
    s, links = S(1, 1, 1), model.links(model.cluster.whole, S(1, 1, 1))
    b, prompt, new, ends, n_mbs = 8, 48, 10, (3, 5, 5, 6, 7, 7, 8, 8), 2
    got = timer.generate_varied(s, links, b, prompt, ends, n_mbs, new).time
    extra = kept_attention_s(timer, 1, b, new, prompt - new)
    assert extra > 0
    monkeypatch.setattr(call_time, "with_kept_keys", lambda timer, stages, *a: list(stages))  # as before
    before = timer.generate_varied(s, links, b, prompt, ends, n_mbs, new).time
    # pp 1: micro-batches one after another, every block of each prefill attends the kept keys
    assert got - before == pytest.approx(n_mbs * cfg.n_layers * extra, rel=1e-9)


def test_turn_two_of_a_multiturn_call_carries_it(monkeypatch):
    from test_turn_profile import P, _env, _spec

    profile = {"policy_tokens": [12, 6], "observation_tokens": [9], "reach": [1.0, 0.5], "step_s": 0.1,
               "final_s": 0.01}
    cost = CostModel(build_graph(_spec(_env(turn_profile=profile, env_workers=4))))
    mesh, s = cost.graph.spec.cluster.device_meshes()[0], S(1, 1, 1)
    timer, links = cost._timer(cost.graph.model_config("actor_gen")), cost.links(mesh, s)
    turns = cost.turns("actor_gen", mesh, s, 2)
    # turn 2: 16 rollouts in 2 micro-batches of 8, prompt P + 12 + 9, prefilling the last token and 9 observation
    # tokens after the P + 11 kept positions
    assert turns[1].generate == timer.generate_varied(s, links, 8, P + 21, (6,) * 8, 2, 10)
    extra = kept_attention_s(timer, 1, 8, 10, P + 11)
    monkeypatch.setattr(call_time, "with_kept_keys", lambda timer, stages, *a: list(stages))
    assert turns[1].generate.time - cost.turns("actor_gen", mesh, s, 2)[1].generate.time == \
        pytest.approx(2 * timer.cfg.n_layers * extra, rel=1e-9)
    assert extra > 0 and turns[0].generate == cost.turns("actor_gen", mesh, s, 2)[0].generate  # nothing kept


def test_both_simulators_agree_on_a_multiturn_space_with_kept_caches(tmp_path):
    from realloc.api import load_experiment as load
    from realloc.search import reference
    from realloc.search.build import PlanSpace
    from run_helpers import REPO
    from test_multiturn_stream_plan import EXPERIMENT

    path = tmp_path / "kept.py"
    path.write_text(EXPERIMENT.replace("REPO", str(REPO)))
    graph = build_graph(load(str(path)))
    space = PlanSpace.build(graph, CostModel(graph, discover=False), max_n_mbs=2)
    rng = np.random.default_rng(7)
    for _ in range(100):
        idx = np.array([rng.integers(len(k)) for k in space.problem.candidates], np.int32)
        assert space.evaluate(idx) == reference.evaluate(space.problem, idx)
