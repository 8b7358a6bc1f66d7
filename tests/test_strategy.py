"""Parallel strategies and candidate counts against brute-force enumeration."""

import dataclasses
import itertools

import pytest

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.algorithms.registry import Interface
from realloc.api import ModelFunctionCallDef, TRAIN_STEP, GENERATE, auto, experiment_spec
from realloc.graph.dataflow import build_graph
from realloc.models.config import get_model_config
from realloc.search.candidates import call_options
from realloc.strategy import ParallelStrategy, enumerate_strategies, micro_batch_options


def test_rank_order_is_tp_then_dp_then_pp():
    s = ParallelStrategy(dp=2, tp=2, pp=2)
    assert [s.coords(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert s.coords(4) == (0, 0, 1)
    assert all(s.rank(*s.coords(r)) == r for r in range(8))


@pytest.mark.parametrize("bad", [dict(dp=0, tp=1, pp=1), dict(dp=1, tp=-1, pp=1), dict(dp=1, tp=1, pp=1.5)])
def test_strategy_rejects_bad_degrees(bad):
    with pytest.raises(ValueError, match="ParallelStrategy"):
        ParallelStrategy(**bad)


def _brute_force(cfg, world, per_node, n_seqs):
    out = set()
    for dp, tp, pp in itertools.product(range(1, world + 1), repeat=3):
        if dp * tp * pp != world:
            continue
        # whole q heads and MLP shards per rank; KV heads split or replicated; any vocabulary (padded)
        kv_ok = cfg.n_kv_heads % tp == 0 or tp % cfg.n_kv_heads == 0
        shards_ok = cfg.n_heads % tp == 0 and cfg.intermediate_size % tp == 0
        if not (kv_ok and shards_ok) or per_node % tp or pp > cfg.n_layers or n_seqs % dp:
            continue
        out.add((dp, tp, pp))
    return out


@pytest.mark.parametrize("model,world,per_node,n_seqs", [
    ("tiny", 4, 4, 8), ("tiny-gqa", 4, 4, 8), ("llama3-8b", 16, 8, 64), ("llama3-13b", 8, 8, 512),
    ("tiny", 8, 2, 6),
])
def test_enumerate_strategies_matches_brute_force(model, world, per_node, n_seqs):
    cfg = get_model_config(model)
    got = {(s.dp, s.tp, s.pp) for s in enumerate_strategies(cfg, world, per_node, n_seqs)}
    assert got == _brute_force(cfg, world, per_node, n_seqs)


def test_llama3_13b_tp_must_divide_40_heads():
    cfg = get_model_config("llama3-13b")
    assert {s.tp for s in enumerate_strategies(cfg, 8, 8, 512)} == {1, 2, 4, 8}
    cfg = get_model_config("tiny-gqa")  # 2 KV heads: tp=4 replicates each on 2 ranks
    assert {s.tp for s in enumerate_strategies(cfg, 4, 4, 8)} == {1, 2, 4}
    # 3 KV heads of 6 heads: tp=2 neither divides nor is a multiple of them
    odd = dataclasses.replace(get_model_config("tiny"), n_heads=6, n_kv_heads=3, hidden_size=96, vocab_size=96,
                              intermediate_size=192)
    assert {s.tp for s in enumerate_strategies(odd, 6, 6, 6)} == {1, 3, 6}


def test_micro_batch_options():
    assert micro_batch_options(8, 1) == [1, 2, 4, 8]
    assert micro_batch_options(12, 2) == [1, 2]
    assert micro_batch_options(7, 2) == []


def _spec(nodelist, per_node, device, model, batch, interface=GENERATE, n_minibatches=1):
    # One call of the given type that reads the prompts (its placements are all that matters here).
    probe = Interface("probe", interface, "realloc.algorithms.common:actor_generate", inputs=("prompts",),
                      config="ppo", config_type=PPOConfig)

    # lengths within tiny's 256 positions (the default 1024 + 1024 is refused by build_graph)
    @auto(nodelist=nodelist, n_devices_per_node=per_node, device=device, batch_size=batch, prompt_len=64, gen_len=64)
    @dataclasses.dataclass
    class Exp:
        interfaces = [probe]

        @property
        def rpcs(self):
            return [ModelFunctionCallDef(name="c", model_name="m", model_type=model, interface_type=interface,
                                         interface_impl="probe", input_data=["prompts"], n_minibatches=n_minibatches)]
    return experiment_spec(Exp)


def test_candidate_count_one_node_of_four_by_hand():
    # meshes: 4 x 1 device, 2 x 2 devices, 1 x 4 devices; tiny has 4 heads/4 KV heads/4 layers; batch 8.
    # 1 device: (1,1,1) x mbs{1,2,4,8} = 4, per mesh -> 16
    # 2 devices: (2,1,1) x {1,2,4} + (1,2,1) x 4 + (1,1,2) x 4 = 11, per mesh -> 22
    # 4 devices: (4,1,1) x 2 + (2,2,1) x 3 + (2,1,2) x 3 + (1,4,1) x 4 + (1,2,2) x 4 + (1,1,4) x 4 = 20
    graph = build_graph(_spec("n1", 4, "cpu", "tiny", 8))
    assert len(call_options(graph, "c")) == 16 + 22 + 20


def test_train_candidates_use_the_minibatch_size():
    graph = build_graph(_spec("n1", 4, "cpu", "tiny", 16, TRAIN_STEP, n_minibatches=2))
    # 16 seqs / 2 mini-batches = the 8-sequence case above, each with and without recomputation
    opts = call_options(graph, "c")
    assert len(opts) == 2 * 58 and sum(o.recompute for o in opts) == 58


def test_an_8x8_cluster_has_over_500_options_per_call():
    # realhf.txt section 5.2: "in a cluster of shape (8, 8), there are over 500 options for each call"
    graph = build_graph(_spec("com[01-08]", 8, "a100-80g", "llama2-7b", 512))
    assert len(call_options(graph, "c")) > 500
