"""Model-type registry against realhf-appendix.txt Table 1."""

import pytest

from realloc.models.config import get_model_config, is_known_model_type, known_model_types
from realloc.models.param_layout import param_specs, shard_numel, stage_layer_ranges, stage_param_specs

# realhf-appendix.txt Table 1: (TotalParamCount, ParamCount w/o output embedding)
TABLE1 = {
    "llama3-8b": (8030261248, 7504924672),
    "llama3-13b": (14001525760, 13344855040),
    "llama3-34b": (35321028608, 34270355456),
    "llama3-70b": (70553706496, 69503033344),
}


@pytest.mark.parametrize("name", sorted(TABLE1))
def test_table1_parameter_counts(name):
    cfg = get_model_config(name)
    total, without_head = TABLE1[name]
    assert cfg.total_params == total
    assert cfg.params_without_output_embedding == without_head


def test_llama2_7b_is_the_published_6_7b_shape():
    assert get_model_config("llama2-7b").total_params == 6738415616
    assert get_model_config("llama7b") == get_model_config("llama2-7b")


def test_critic_swaps_vocab_head_for_scalar():
    actor, critic = get_model_config("llama3-8b"), get_model_config("llama3-8b-critic")
    assert critic.is_critic and critic.output_dim == 1
    assert critic.total_params == actor.params_without_output_embedding + actor.hidden_size
    assert critic.name == "llama3-8b-critic"


def test_unknown_model_type_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model_type 'llama9'.*llama3-8b"):
        get_model_config("llama9")
    assert not is_known_model_type("llama9-critic")
    assert "tiny-critic" in known_model_types() and is_known_model_type("rule")


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "small", "llama3-70b", "tiny-critic"])
def test_param_layout_covers_the_model_exactly(name):
    cfg = get_model_config(name)
    assert sum(s.numel for s in param_specs(cfg)) == cfg.total_params
    for pp in (1, 2, cfg.n_layers):
        names = [s.name for r in range(pp) for s in stage_param_specs(cfg, pp, r)]
        assert sorted(names) == sorted(s.name for s in param_specs(cfg))
    for tp in (1, 2, 4):
        # every element is held by one primary rank; the others hold copies
        primaries = sum(s.shard_numel(tp) for s in param_specs(cfg) for r in range(tp) if s.is_primary(tp, r))
        assert primaries == cfg.total_params
        if cfg.n_kv_heads % tp:
            continue
        replicated = sum(s.numel for s in param_specs(cfg) if s.tp_dim is None)
        per_rank = shard_numel(cfg, tp, 1, 0)
        assert per_rank * tp == cfg.total_params + (tp - 1) * replicated


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    import dataclasses

    import torch

    # tiny-gqa: 4 heads of width 16, 2 KV heads (k/v 32 x 64); at tp=4 ranks 0,1 hold head 0 and 2,3 head 1
    cfg = dataclasses.replace(get_model_config("tiny-gqa"), qkv_bias=True)
    assert cfg.total_params == get_model_config("tiny-gqa").total_params + 4 * (64 + 2 * 32)
    specs = {s.name: s for s in param_specs(cfg)}
    k, kb = specs["model.layers.0.self_attn.k_proj.weight"], specs["model.layers.0.self_attn.k_proj.bias"]
    q = specs["model.layers.0.self_attn.q_proj.weight"]
    assert [k.shard_interval(4, r) for r in range(4)] == [(0, 16), (0, 16), (16, 32), (16, 32)]
    assert [kb.shard_interval(4, r) for r in range(4)] == [(0, 16), (0, 16), (16, 32), (16, 32)]
    assert [q.shard_interval(4, r) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert k.shard_shape(4) == (16, 64) and k.shard_numel(4) == 16 * 64 and k.shard_shape(2) == (16, 64)
    assert [k.is_primary(4, r) for r in range(4)] == [True, False, True, False]
    assert (k.tp_replicas(4), k.tp_replicas(2), k.tp_replicas(1), q.tp_replicas(4)) == (2, 1, 1, 1)
    full = torch.arange(32 * 64.0).view(32, 64)
    parts = [full[k.shard_slices(4, r)] for r in range(4)]
    assert torch.equal(k.merge_shards(parts), full)
    # per rank at tp=4: a quarter of everything split, whole norms, half of k/v (one of two heads)
    kv = 4 * 2 * (32 * 64 + 32)
    split = cfg.total_params - kv - (4 * 2 + 1) * 64
    assert shard_numel(cfg, 4, 1, 0) == split // 4 + kv // 2 + 9 * 64
    assert (cfg.kv_replicas(4), cfg.local_kv_heads(4), cfg.kv_replicas(2), cfg.local_kv_heads(2)) == (2, 1, 1, 1)


def test_stage_ranges_are_balanced_and_contiguous():
    assert stage_layer_ranges(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(ValueError, match="pp=5"):
        stage_layer_ranges(4, 5)
