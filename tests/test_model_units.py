"""Single-process checks of the model package's pure pieces against brute force and HF formulas."""

from __future__ import annotations

import dataclasses
import json
import itertools

import pytest
import torch

from realloc.models.batch import split_batch, token_layout
from realloc.models.config import ModelConfig, get_model_config
from realloc.models.groups import ModelLayout
from realloc.models.hf_io import hf_config_from_model_config, model_config_from_hf, shard_file_plan
from realloc.models.param_layout import param_specs, stage_param_specs
from realloc.models.sampling import GenerationConfig, filtered_sorted, sample_tokens, sequence_generators
from realloc.strategy import ParallelStrategy


# -- sampling --------------------------------------------------------------------------------------


def _brute_force_filter(logits: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Kept tokens and their renormalized probabilities, one token at a time."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if top_k:
        order = order[:top_k]
    z = sum(torch.tensor(x[i]).exp().item() for i in order)
    probs = {i: torch.tensor(x[i]).exp().item() / z for i in order}
    kept, mass = {}, 0.0
    for i in order:
        if mass >= top_p:
            break
        kept[i] = probs[i]
        mass += probs[i]
    total = sum(kept.values())
    return {i: p / total for i, p in kept.items()}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)])
def test_filter_matches_brute_force(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, generator=g) * 2
    gc = GenerationConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    probs, order = filtered_sorted(logits, gc)
    for row in range(3):
        want = _brute_force_filter(logits[row].tolist(), temperature, top_k, top_p)
        got = {int(order[row, j]): float(probs[row, j]) for j in range(20) if probs[row, j] > 0}
        assert got.keys() == want.keys()
        for k in want:
            assert abs(got[k] - want[k]) < 1e-6


def test_sampling_inverts_the_cdf_of_each_sequences_own_stream():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    gc = GenerationConfig(max_new_tokens=1, temperature=0.8, top_k=10, top_p=0.9, seed=3)
    tokens, logp = sample_tokens(logits, gc, sequence_generators(3, [10, 11, 12, 13]))
    draws = [torch.rand((), generator=gen, dtype=torch.float64).item() for gen in sequence_generators(3, [10, 11, 12, 13])]
    for row, u in enumerate(draws):
        kept = sorted(_brute_force_filter(logits[row].tolist(), 0.8, 10, 0.9).items(), key=lambda kv: -kv[1])
        acc, pick = 0.0, kept[-1][0]
        for tok, p in kept:
            acc += p
            if u < acc:
                pick = tok
                break
        assert int(tokens[row]) == pick
        assert abs(float(logp[row]) - torch.log_softmax(logits[row] / 0.8, -1)[pick].item()) < 1e-6
    # A row's token depends on its own id only, not on its neighbours.
    alone, _ = sample_tokens(logits[2:3], gc, sequence_generators(3, [12]))
    assert int(alone[0]) == int(tokens[2])


def test_greedy_and_banned_tokens():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 0.0, 0.0]])
    gc = GenerationConfig(max_new_tokens=1, greedy=True)
    tok, lp = sample_tokens(logits, gc, [])
    assert tok.tolist() == [1, 0]  # ties go to the lowest id, like torch.argmax / HF
    tok, lp = sample_tokens(logits, gc, [], ban=torch.tensor([0]))
    assert tok.tolist() == [1, 1]
    # Log-probs score the unbanned distribution, as a forward pass would.
    assert abs(float(lp[1]) - torch.log_softmax(logits[1], -1)[1].item()) < 1e-6


@pytest.mark.parametrize("kw,field", [({"max_new_tokens": 0}, "max_new_tokens"),
                                      ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens"),
                                      ({"max_new_tokens": 4, "temperature": 0.0}, "temperature"),
                                      ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
                                      ({"max_new_tokens": 4, "top_p": 0.0}, "top_p")])
def test_generation_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"GenerationConfig.{field}"):
        GenerationConfig(**kw)


# -- batches and masks -----------------------------------------------------------------------------


def test_token_layouts_of_the_three_input_forms():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    a = token_layout({"input_ids": ids, "lengths": torch.tensor([3, 2])})
    assert a.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert a.segment_ids.tolist() == [[0, 0, 0, -1], [0, 0, -1, -1]]
    left = token_layout({"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])})
    assert left.position_ids.tolist() == [[0, 0, 1, 2], [0, 0, 0, 1]]
    packed = token_layout({"input_ids": torch.tensor([1, 2, 3, 4, 5]), "cu_seqlens": torch.tensor([0, 2, 5])})
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2]]
    assert packed.segment_ids.tolist() == [[0, 0, 1, 1, 1]]
    assert packed.next_token_valid().tolist() == [[True, False, True, True]]
    # Only one right-padded sequence per row may skip the explicit mask.
    assert a.causal_suffices and a.attention_mask() is None
    assert not left.causal_suffices and not packed.causal_suffices
    assert packed.attention_mask().shape == (1, 1, 5, 5)


@pytest.mark.parametrize("batch,msg", [
    ({"lengths": torch.tensor([1])}, "missing key 'input_ids'"),
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, "give exactly one of"),
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long), "lengths": torch.tensor([4, 1])}, "'lengths' must be"),
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 2)}, "'attention_mask' must"),
    ({"input_ids": torch.zeros(5, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3])}, "'cu_seqlens' must"),
    ({"input_ids": torch.zeros(2, 3), "lengths": torch.tensor([1, 1])}, "integer tensor"),
])
def test_bad_batches_raise_one_value_error(batch, msg):
    with pytest.raises(ValueError, match=msg):
        token_layout(batch, "forward")


def test_rows_longer_than_the_models_maximum_are_refused():
    """Issue 30, defect 6: forward and train_step pass the model's max_position_embeddings (engine.py); a row of
    more tokens is one error, whatever the input form; a row of exactly that many is accepted."""
    ids = torch.ones(2, 6, dtype=torch.long)
    for batch in ({"input_ids": ids, "lengths": torch.tensor([6, 2])},
                  {"input_ids": ids, "attention_mask": torch.ones(2, 6)},
                  {"input_ids": torch.ones(8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 2, 8])}):
        with pytest.raises(ValueError, match="forward: a sequence of 6 tokens exceeds the model's "
                                             "max_position_embeddings=5"):
            token_layout(batch, "forward", max_positions=5)
        token_layout(batch, "forward", max_positions=6)


def _too_long_rows(ctx) -> list[str]:
    """forward and train_step of a model with max_position_embeddings=8, on rows of 9 tokens and of 8."""
    from realloc.cluster import ClusterSpec
    from realloc.models.engine import ParallelModel

    cfg = dataclasses.replace(get_model_config("tiny"), max_position_embeddings=8)
    lay = ModelLayout.for_model(cfg, ClusterSpec.from_nodelist("n1", 1).mesh("n1:0"), ParallelStrategy(1, 1, 1))
    ctx.groups.ensure_layouts([lay])
    model = ParallelModel(cfg, ctx.groups.model_groups(lay), seed=1)
    opt = model.make_optimizer(lr=1e-3)

    def loss(out, mb):
        return out.logprobs().mean(), {}

    errors = []
    for n in (9, 8):
        batch = {"input_ids": torch.ones(2, n, dtype=torch.long), "lengths": torch.tensor([n, 2])}
        for run in (lambda: model.forward(batch), lambda: model.train_step([batch], loss, opt)):
            try:
                run()
                errors.append("")
            except ValueError as e:
                errors.append(str(e))
    return errors


def test_forward_and_train_step_refuse_rows_longer_than_the_model_takes(tmp_path):
    from mp_pool import GlooPool

    with GlooPool(1, tmp_path) as pool:
        fwd9, train9, fwd8, train8 = pool.run(_too_long_rows)[0]
    assert "forward: a sequence of 9 tokens exceeds the model's max_position_embeddings=8" in fwd9
    assert "train_step micro-batch 0: a sequence of 9 tokens exceeds the model's max_position_embeddings=8" in train9
    assert fwd8 == "" and train8 == ""


def test_split_batch_splits_row_tensors_only():
    b = {"input_ids": torch.arange(10).view(5, 2), "lengths": torch.full((5,), 2), "scale": torch.tensor(3.0)}
    parts = split_batch(b, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2]
    assert all(p["scale"] is b["scale"] for p in parts)
    with pytest.raises(ValueError, match="n_mbs=6"):
        split_batch(b, 6)


def test_masks_match_brute_force():
    from realloc.models.llama import cache_mask, segment_mask

    seg = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, -1, -1]])
    m = segment_mask(seg)[:, 0]
    for b, i, j in itertools.product(range(2), range(6), range(6)):
        want = i == j or (j <= i and seg[b, i] == seg[b, j] and seg[b, j] >= 0)
        assert bool(m[b, i, j]) == want
    valid = torch.tensor([[False, True, True, True, True], [True, True, False, True, True]])
    c = cache_mask(valid, 3, 2)[:, 0]
    for b, q, k in itertools.product(range(2), range(2), range(5)):
        slot = 3 + q
        assert bool(c[b, q, k]) == (k == slot or (k <= slot and bool(valid[b, k])))


# -- HF config mapping and RoPE --------------------------------------------------------------------


def test_rope_frequencies_match_hf_default_and_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from realloc.models.llama import rope_inv_freq

    for rope in ({"rope_type": "default", "rope_theta": 500000.0},
                 {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}):
        hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_parameters=rope,
                         max_position_embeddings=131072)
        cfg = model_config_from_hf(hf.to_dict(), name="x")
        if rope["rope_type"] == "default":
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
            ref = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
        else:
            ref = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0]
        assert torch.allclose(rope_inv_freq(cfg), ref, rtol=1e-6, atol=0), rope["rope_type"]


def test_hf_config_round_trip_and_errors():
    qwen = dataclasses.replace(get_model_config("tiny-gqa"), name="q", family="qwen2", qkv_bias=True,
                               rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True)
    for cfg in (get_model_config("llama3-8b"), get_model_config("tiny-gqa-critic"),
                ModelConfig("t", 64, 64, 176, 2, 4, 2, tie_embeddings=True, rope_scaling=(8.0, 1.0, 4.0, 64)),
                qwen, qwen.as_critic()):
        hf = hf_config_from_model_config(cfg)
        assert hf["model_type"] == cfg.family
        back = model_config_from_hf(hf, name=cfg.name)
        assert back == cfg
    assert hf_config_from_model_config(qwen)["architectures"] == ["Qwen2ForCausalLM"]
    assert hf_config_from_model_config(qwen.as_critic())["architectures"] == ["Qwen2ForSequenceClassification"]
    with pytest.raises(ValueError, match="qkv_bias=True cannot be written as a llama checkpoint"):
        hf_config_from_model_config(dataclasses.replace(qwen, family="llama"))
    # Older configs carry rope_theta at the top level and no rope_parameters.
    old = {k: v for k, v in hf_config_from_model_config(qwen).items() if k not in ("rope_parameters", "rope_scaling")}
    assert model_config_from_hf(old, name="q") == qwen


@pytest.mark.parametrize("family,patch,field", [
    ("llama", {"model_type": "gpt2"}, "model_type='gpt2'"),
    ("llama", {"model_type": "mixtral"}, "model_type='mixtral'"),
    ("qwen2", {"model_type": "qwen3_moe"}, "model_type='qwen3_moe'"),
    # sliding layers without a window: transformers refuses them too (windows it runs: test_model_families2.py)
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types='sliding_attention'"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
    ("llama", {"head_dim": 7}, "head_dim=7"),
    ("llama", {"architectures": ["LlamaForTokenClassification"]}, "architectures=['LlamaForTokenClassification']"),
    ("qwen2", {"architectures": ["LlamaForCausalLM"]}, "architectures="),
    ("qwen2", {"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 3}, "num_labels=3"),
    # transformers >= 5 writes neither num_labels nor id2label for its default of 2 labels
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "num_labels=2"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}},
     "num_labels=2"),
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "'quant_method': 'gptq'"),
])
def test_unsupported_hf_configs_are_one_line_naming_the_path_and_field(tmp_path, family, patch, field):
    import json

    cfg = dataclasses.replace(get_model_config("tiny-gqa"), family=family, qkv_bias=family == "qwen2")
    (tmp_path / "config.json").write_text(json.dumps({**hf_config_from_model_config(cfg), **patch}))
    with pytest.raises(ValueError) as e:
        model_config_from_hf(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"HF checkpoint {tmp_path}: ")
    assert field in msg, msg
    assert "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg, msg  # says what is supported


@pytest.mark.parametrize("over", [
    dict(use_sliding_window=False, max_window_layers=1),  # Qwen2.5's published form: no window anywhere
    dict(use_sliding_window=True, max_window_layers=4),  # a window from layer 4 of 4 layers: none
    dict(use_sliding_window=True, max_window_layers=9),
    dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),
    dict(use_sliding_window=True, max_window_layers=3),  # layer 3 has a window
    dict(use_sliding_window=True, max_window_layers=0),
    dict(use_sliding_window=True),  # transformers' default max_window_layers 28 > 4 layers
])
def test_qwen2_sliding_window_follows_transformers(over):
    from transformers import Qwen2Config

    from realloc.models.families.qwen2 import layer_types

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2)
    hf = Qwen2Config(**base, **over)
    assert layer_types({**base, **over}) == hf.layer_types
    d = {**base, **over, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    cfg = model_config_from_hf(d)  # each layer windowed exactly where transformers windows it
    assert [cfg.windowed(i) for i in range(4)] == [t == "sliding_attention" for t in hf.layer_types]
    assert cfg.sliding_window == (hf.sliding_window if "sliding_attention" in hf.layer_types else None)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_defaults_are_transformers_defaults(family):
    """A config.json that omits a key means transformers' default for it."""
    from transformers import LlamaConfig, Qwen2Config

    d = {"model_type": family, "vocab_size": 64, "hidden_size": 128, "intermediate_size": 176,
         "num_hidden_layers": 2, "num_attention_heads": 32}  # Qwen2Config's default KV heads are 32
    ours = model_config_from_hf(d)
    theirs = (LlamaConfig if family == "llama" else Qwen2Config)(**{k: v for k, v in d.items() if k != "model_type"})
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.n_kv_heads == theirs.num_key_value_heads and ours.tie_embeddings == theirs.tie_word_embeddings


def test_hf_config_missing_key():
    broken = hf_config_from_model_config(get_model_config("tiny"))
    del broken["vocab_size"]
    with pytest.raises(ValueError, match="missing key 'vocab_size'"):
        model_config_from_hf(broken)


@pytest.mark.parametrize("key,value,says", [
    ("num_key_value_heads", 3, "num_attention_heads must be divisible by num_key_value_heads"),
    ("hidden_size", 102, "hidden_size must be divisible by num_attention_heads"),
    ("num_hidden_layers", 0, "num_hidden_layers must be positive"),
    ("vocab_size", "many", "invalid literal"),
])
def test_a_bad_shape_in_config_json_names_the_checkpoint_and_its_keys(key, value, says):
    hf = hf_config_from_model_config(get_model_config("tiny"))
    hf[key] = value
    with pytest.raises(ValueError) as e:
        model_config_from_hf(hf, name="actor")
    msg = str(e.value)
    assert msg.startswith("HF config actor: ") and says in msg and "fix config.json" in msg, msg
    assert msg.count("HF config") == 1, msg


@pytest.mark.parametrize("pp,limit", [(1, 4 << 30), (2, 4 << 30), (3, 30_000)])
def test_shard_file_plan_writes_each_parameter_once(pp, limit):
    cfg = dataclasses_replace_tied(get_model_config("tiny"))
    plan = shard_file_plan(cfg, pp, torch.float32, limit)
    names = [n for _, _, ns in plan for n in ns]
    assert sorted(names) == sorted(s.name for s in param_specs(cfg))
    sizes = {s.name: s.numel * 4 for s in param_specs(cfg)}
    for stage, fname, ns in plan:
        own = {s.name for s in stage_param_specs(cfg, pp, stage)}
        assert set(ns) <= own
        assert len(ns) == 1 or sum(sizes[n] for n in ns) <= limit
    assert len({f for _, f, _ in plan}) == len(plan)


def dataclasses_replace_tied(cfg: ModelConfig) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, tie_embeddings=True)


# -- layouts and gradient-norm accounting ----------------------------------------------------------


def test_layout_groups_match_brute_force():
    s = ParallelStrategy(dp=2, tp=2, pp=2)
    ids = (7, 6, 5, 4, 3, 2, 1, 0)
    lay = ModelLayout(ids, s, tie_embeddings=True)
    coords = {ids[r]: s.coords(r) for r in range(8)}
    for rank, (d, t, p) in coords.items():
        assert lay.coords_of(rank) == (d, t, p)
        assert set(lay.tp_ranks(d, p)) == {r for r, c in coords.items() if c[0] == d and c[2] == p}
        assert set(lay.dp_ranks(t, p)) == {r for r, c in coords.items() if c[1] == t and c[2] == p}
        assert [coords[r][2] for r in lay.pp_ranks(d, t)] == [0, 1]
    sets = lay.rank_sets()
    assert len(sets) == 1 + 4 + 4 + 4 + 4 and tuple(sorted(ids)) in sets
    with pytest.raises(ValueError, match="cannot hold strategy"):
        ModelLayout((0, 1, 2), s)
    with pytest.raises(ValueError, match="distinct"):
        ModelLayout((0, 0, 1, 2, 3, 4, 5, 6), s)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_every_parameter_element_counts_once_toward_the_grad_norm(tp, pp):
    from types import SimpleNamespace

    from realloc.models.grads import counts_toward_norm

    cfg = dataclasses_replace_tied(get_model_config("tiny"))
    counted = 0
    for p, t in itertools.product(range(pp), range(tp)):
        g = SimpleNamespace(tp=tp, pp=pp, tp_rank=t, pp_rank=p)
        counted += sum(s.shard_numel(tp) for s in stage_param_specs(cfg, pp, p) if counts_toward_norm(s, g))
    assert counted == cfg.total_params


def test_vocab_limit_bans_ids_from_the_choice_not_from_the_log_prob():
    from realloc.models.sampling import GenerationConfig, sample_tokens, sequence_generators

    # The best logits sit on ids 2 and 3, past a limit of 2: neither greedy nor sampling may pick them.
    logits = torch.tensor([[0.0, 1.0, 10.0, 10.0]]).repeat(64, 1)
    ref = torch.log_softmax(logits[0], -1)  # the model's own distribution, which an inference pass scores
    greedy = GenerationConfig(max_new_tokens=1, greedy=True, vocab_limit=2)
    tok, lp = sample_tokens(logits, greedy, sequence_generators(0, range(64)))
    assert tok.eq(1).all() and torch.allclose(lp, ref[1].expand(64))
    for top_k in (0, 3):
        g = GenerationConfig(max_new_tokens=1, top_k=top_k, vocab_limit=2)
        tok, lp = sample_tokens(logits, g, sequence_generators(0, range(64)))
        assert set(tok.tolist()) == {0, 1}  # both allowed ids are drawn (1 about e times as often as 0)
        assert torch.allclose(lp, ref[tok])
    # Without the limit the same draws take the padding ids: the limit is what keeps them out.
    tok, _ = sample_tokens(logits, GenerationConfig(max_new_tokens=1), sequence_generators(0, range(64)))
    assert set(tok.tolist()) >= {2, 3}
    with pytest.raises(ValueError, match="vocab_limit"):
        GenerationConfig(max_new_tokens=1, vocab_limit=0)



def test_weight_headers_are_checked_against_the_loader(tmp_path):
    """check_hf_weights reads only safetensors headers: every tensor the loader reads, with its shape and a float
    dtype; a fresh value head is not read; an index that omits a tensor is named."""
    from safetensors.torch import save_file

    from realloc.models.hf_io import check_hf_weights

    cfg = get_model_config("tiny-gqa")
    full = {s.name: torch.zeros(s.shape) for s in param_specs(cfg)}
    save_file(full, str(tmp_path / "model.safetensors"))
    check_hf_weights(cfg, tmp_path)
    check_hf_weights(cfg.as_critic(), tmp_path, new_value_head=True)  # lm_head ignored, score.weight made
    with pytest.raises(ValueError, match=r"'score.weight' is missing from model.safetensors.*new_value_head=True"):
        check_hf_weights(cfg.as_critic(), tmp_path)
    save_file({**full, "model.norm.weight": torch.zeros(cfg.hidden_size, dtype=torch.int8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' in model.safetensors is stored as I8"):
        check_hf_weights(cfg, tmp_path)
    # sharded: the index is what the loader follows
    save_file(full, str(tmp_path / "model-1.safetensors"))
    index = {"weight_map": {n: "model-1.safetensors" for n in full if n != "lm_head.weight"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'lm_head.weight' is missing from model.safetensors.index.json's weight_map"):
        check_hf_weights(cfg, tmp_path, where="model 'actor': ")
