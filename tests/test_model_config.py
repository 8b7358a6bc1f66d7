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
        if cfg.n_kv_heads % tp:
            continue
        replicated = sum(s.numel for s in param_specs(cfg) if s.tp_dim is None)
        per_rank = shard_numel(cfg, tp, 1, 0)
        assert per_rank * tp == cfg.total_params + (tp - 1) * replicated


def test_stage_ranges_are_balanced_and_contiguous():
    assert stage_layer_ranges(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(ValueError, match="pp=5"):
        stage_layer_ranges(4, 5)
