"""Gemma 3 text (``gemma3_text``) against HuggingFace transformers.

A tiny random Gemma3ForCausalLM (4 layers, head_dim 32, 2 KV heads, tied embeddings, query_pre_attn_scalar 20 (not
head_dim), the windowed layers 0, 1 and 3 at 5 tokens with RoPE base 1e4, layer 2 full with base 1e6, every norm
random) is loaded into (tp, pp) layouts on 4 gloo processes: logits, log-probs, entropies and greedy tokens equal
the dense HF model's, critic values its sequence classifier's, train steps its gradients, and a saved checkpoint
loads back in transformers with equal logits. A test shows each Gemma 3 difference changes transformers' logits.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from realloc.models.config import ModelConfig
from realloc.models.hf_io import hf_config_from_model_config, model_config_from_hf
from realloc.models.param_layout import param_specs
from model_helpers import assemble, tiny_hf_config, tiny_hf_model
from mp_pool import GlooPool
from test_model_hf import _check_against_hf, _critic_values, _padded_batch, _save
from test_model_train import _check_train

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
GEMMA3 = dict(family="gemma3_text", kv_heads=2, head_dim=32, tie=True, sliding_window=5, sliding_window_pattern=3,
              query_pre_attn_scalar=20)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gemma3")
    return tiny_hf_model(path, seed=61, **GEMMA3), path


@torch.no_grad()
def test_gemma3_reads_its_shape_and_each_difference_matters(gemma3):
    """The shape, windows, RoPE bases and attention scale are read and the parameters counted as transformers'; the
    local RoPE base, the attention scale, the post-sublayer norms and the window each change transformers' logits."""
    hf, path = gemma3
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.head_dim, cfg.tie_embeddings, cfg.qk_norm, cfg.sandwich_norms, cfg.norm_plus_one,
            cfg.embed_scale, cfg.sliding_window, cfg.full_attention_layers, cfg.rope_theta, cfg.local_rope_theta,
            cfg.query_pre_attn_scalar) == ("gemma3_text", 32, True, True, True, True, True, 5, (2,), 1e6, 1e4, 20.0)
    assert cfg.total_params == sum(p.numel() for p in hf.parameters()) == sum(s.numel for s in param_specs(cfg))
    ids, _, mask = _padded_batch()
    ref = hf(input_ids=ids, attention_mask=mask).logits
    one_base = copy.deepcopy(hf)
    one_base.model.rotary_emb.sliding_attention_inv_freq.copy_(one_base.model.rotary_emb.full_attention_inv_freq)
    scaled = copy.deepcopy(hf)
    no_post = copy.deepcopy(hf)
    for a, b in zip(scaled.model.layers, no_post.model.layers):
        a.self_attn.scaling = 32 ** -0.5
        b.post_feedforward_layernorm.weight.zero_()
        b.post_attention_layernorm.weight.zero_()
    for other in (one_base, scaled, no_post):
        assert (other(input_ids=ids, attention_mask=mask).logits - ref).abs().max() > 1e-3


@torch.no_grad()
def test_gemma3_matches_hf_logits_and_greedy(pool, gemma3):
    hf, path = gemma3
    _check_against_hf(pool, hf, path, LAYOUTS)


def test_gemma3_trains_like_the_dense_model(pool, gemma3):
    """SGD at lr 1 at tp 2 (sequence parallel) and pp 2; AdamW over two steps at tp 2 / pp 2: the (1 + w) q/k head
    norms' and the four layer norms' gradients included."""
    hf, path = gemma3
    _check_train(pool, hf, path, [(1, 2, 1), (1, 1, 2)], "sgd", 1, None)
    # This random model's fp32 gradients are less exact than a LLaMA's: transformers' own fp32 and fp64 gradients
    # differ by up to 4.6e-5 (Gemma's by 1.2e-7; the (1 + w) head norms and the post-sublayer norms scale up), and
    # Adam's normalized update turns such rounding into differences of about lr * 3e-3 in near-zero elements.
    _check_train(pool, hf, path, [(1, 2, 2)], "adamw", 2, 1.0, atol=1e-4)


def _critic_matches(pool, path, kw: dict, seed: int, arch: str) -> None:
    """A random sequence classifier of ``kw``'s family: realloc's values at tp 1, tp 2 and pp 2 are its scores."""
    hf = tiny_hf_model(path, seed=seed, critic=True, **kw)
    assert type(hf).__name__ == arch
    cfg = model_config_from_hf(path)
    assert cfg.is_critic and not cfg.tie_embeddings and cfg.family == hf.config.model_type
    ids, lens, mask = _padded_batch(seed=5)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        last = pool.run(_critic_values, cfg, tp, pp, str(path), ids, lens)[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (tp, pp, (last - ref).abs().max())


def _saves_and_loads_back(pool, hf, src, out) -> dict:
    """Saved at tp 2 / pp 2: transformers' tensors, and the model transformers loads gives its logits; the
    config.json written."""
    from transformers import AutoModelForCausalLM

    cfg = model_config_from_hf(src)
    saved = assemble(pool.run(_save, cfg, 1, 2, 2, str(src), str(out), 4 << 30), cfg)
    hf_state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding's
    assert set(saved) == set(hf_state) and all(torch.equal(t, hf_state[n]) for n, t in saved.items())
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)
    assert model_config_from_hf(out) == cfg
    return json.loads((out / "config.json").read_text())


@torch.no_grad()
def test_gemma3_critic_values_match_its_sequence_classifier(pool, tmp_path):
    _critic_matches(pool, tmp_path, GEMMA3, 63, "Gemma3TextForSequenceClassification")


@torch.no_grad()
def test_gemma3_saves_and_loads_in_transformers(pool, gemma3, tmp_path):
    hf, src = gemma3
    config = _saves_and_loads_back(pool, hf, src, tmp_path / "a")
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["layer_types"][2] == "full_attention"


def test_gemma3_older_keys_refusals_and_registry_shape():
    """config.json as transformers 4.5x wrote it (rope_theta, rope_local_base_freq, sliding_window_pattern) reads
    as the nested form; soft-capping, RoPE scaling and the rest are one line each; gemma3-1b has Gemma 3 1B's
    parameters as transformers counts them."""
    import transformers

    from realloc.models.config import get_model_config

    base = tiny_hf_config(**{k: v for k, v in GEMMA3.items()}).to_dict()
    new = model_config_from_hf(base)
    old = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None)
    assert model_config_from_hf(old) == new
    linear = {"rope_type": "linear", "factor": 8.0}
    for patch, words in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
                         ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
                         ({"rope_parameters": {**base["rope_parameters"],
                                               "full_attention": {**linear, "rope_theta": 1e6}}}, "'linear'"),
                         ({"attention_bias": True}, "attention_bias"),
                         ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
                         ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
                         ({"model_type": "gemma3"}, "model_type='gemma3'")):
        with pytest.raises(ValueError) as e:
            model_config_from_hf({**base, **patch})
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="rope_type='linear'"):
        model_config_from_hf({**old, "rope_scaling": linear})
    cfg = get_model_config("gemma3-1b")
    hf = hf_config_from_model_config(cfg)
    kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw))
    assert cfg.total_params == sum(p.numel() for p in model.parameters()) == 999_885_952
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + \
        ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"] + \
        ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert model_config_from_hf(hf, name="gemma3-1b") == cfg


def test_gemma3_estimator_counts_its_two_more_norms():
    """The estimator's op counts, kernels and saved bytes of a gemma3-1b block against the same block without the
    norms around the MLP; a profile table of one does not price the other."""
    import dataclasses

    from realloc.estimator import opcount as oc
    from realloc.estimator.hardware import Precision
    from realloc.estimator.profile_table import ModelArch
    from realloc.models.config import get_model_config

    bf16 = Precision.for_dtype("bf16")
    g3 = get_model_config("gemma3-1b")
    plain = dataclasses.replace(g3, sandwich_norms=False)
    assert g3.layer_params - plain.layer_params == 2 * 1152
    n = 4 * 64
    for phase, factor, kernels in ((oc.Phase.FWD, 1, 2), (oc.Phase.PREFILL, 1, 2), (oc.Phase.BWD, 2, 4)):
        a, b = (oc.op_work(c, oc.Part.BLOCK, phase, 1, 4, 64, bf16) for c in (g3, plain))
        assert a.elem_bytes - b.elem_bytes == factor * n * 4 * 1152 * 2, phase
        assert (a.kernels - b.kernels, a.gemm_flops, a.attn_flops) == (kernels, b.gemm_flops, b.attn_flops)
    saved = oc.saved_activation_bytes_per_token(g3, 1, bf16) - oc.saved_activation_bytes_per_token(plain, 1, bf16)
    assert saved == 2 * (2 * 1152 + 4)  # two more lean norms: their input in bf16 and 1/rms in fp32
    assert ModelArch.of(g3) != ModelArch.of(plain) and ModelArch.of(plain).sandwich_norms is None


# Gemma 3's block at the tiny test shape (no window: the masks are priced apart, estimator/mask_memory.py)
SANDWICH = ModelConfig("sandwich", 64, 64, 176, 4, 4, 2, max_position_embeddings=256, explicit_head_dim=32,
                       family="gemma3_text", qk_norm=True, hidden_act="gelu_pytorch_tanh", norm_plus_one=True,
                       embed_scale=True, tie_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=20.0)


def test_gemma3_saved_activations_are_the_memory_models(pool):
    """estimator.memory.train_saved_bytes against the bytes autograd keeps in a Gemma 3 block, per stage."""
    from realloc.estimator.hardware import Precision
    from realloc.estimator.memory import train_saved_bytes
    from realloc.strategy import ParallelStrategy
    from test_model_train import _saved_peak

    fp32 = Precision(param=4, grad=4, optimizer=8, logits=4)
    for dp, tp, pp, n_mbs in [(1, 1, 1, 2), (1, 2, 2, 2)]:
        for recompute in (False, True):
            for r in pool.run(_saved_peak, SANDWICH, dp, tp, pp, n_mbs, recompute):
                if r is not None:
                    k, measured = r
                    want = train_saved_bytes(SANDWICH, ParallelStrategy(dp, tp, pp), n_mbs, k, 3 * 24, fp32, recompute)
                    assert abs(measured - want) <= 0.002 * want, (dp, tp, pp, recompute, k, measured, want)


def test_show_names_gemma3_and_refuses_soft_capping_in_one_line(tmp_path):
    from test_experiment_models import _experiment, _show

    f = _experiment(tmp_path)
    tiny_hf_model(tmp_path / "ckpt/sft", seed=1, **GEMMA3)
    tiny_hf_model(tmp_path / "ckpt/rm", seed=2, critic=True, **GEMMA3)
    r = _show(f)
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":")[0]: ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint ")}
    hf = tiny_hf_model(tmp_path / "count", seed=1, **GEMMA3)
    assert ("gemma3_text, 4 layers, hidden 64, 4 heads (2 KV) x 32, MLP 176, vocabulary 128, q/k head norms, norms "
            "around both sublayers, local RoPE base 10000, tied embeddings, sliding window 5 in 3 of 4 layers, "
            f"{sum(p.numel() for p in hf.parameters()):,} parameters") in lines["checkpoint actor"], lines
    assert "gemma3_text" in lines["checkpoint reward"] and "value head" in lines["checkpoint reward"]
    config = tmp_path / "ckpt/sft/config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "final_logit_softcapping": 30.0}))
    r = _show(f)
    assert r.returncode != 0 and "final_logit_softcapping=30.0 is not supported" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- Gemma 2 ------------------------------------------------------------------------------------------------------

# caps small enough to bind on a tiny random model (Gemma 2's own: 50 and 30); layers 0 and 2 windowed (alternating)
GEMMA2 = dict(family="gemma2", kv_heads=2, head_dim=32, tie=True, sliding_window=5, query_pre_attn_scalar=20,
              attn_logit_softcapping=1.5, final_logit_softcapping=2.0)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gemma2")
    return tiny_hf_model(path, seed=71, **GEMMA2), path


@torch.no_grad()
def test_gemma2_reads_its_shape_and_the_caps_matter(gemma2):
    hf, path = gemma2
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.qk_norm, cfg.sandwich_norms, cfg.sliding_window, cfg.full_attention_layers,
            cfg.local_rope_theta, cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping,
            cfg.final_logit_softcapping) == ("gemma2", False, True, 5, (1, 3), None, 20.0, 1.5, 2.0)
    assert cfg.total_params == sum(p.numel() for p in hf.parameters()) == sum(s.numel for s in param_specs(cfg))
    ids, _, mask = _padded_batch()
    ref = hf(input_ids=ids, attention_mask=mask).logits
    assert ref.abs().max() < 2.0  # capped
    uncapped = copy.deepcopy(hf)
    uncapped.config.final_logit_softcapping = None
    scores = copy.deepcopy(hf)
    for layer in scores.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    for other in (uncapped, scores):
        assert (other(input_ids=ids, attention_mask=mask).logits - ref).abs().max() > 1e-3


@torch.no_grad()
def test_gemma2_matches_hf_logits_and_greedy(pool, gemma2):
    hf, path = gemma2
    _check_against_hf(pool, hf, path, LAYOUTS)


def test_gemma2_trains_like_the_dense_model(pool, gemma2):
    hf, path = gemma2
    _check_train(pool, hf, path, [(1, 2, 1), (1, 1, 2)], "sgd", 1, None)
    _check_train(pool, hf, path, [(1, 2, 2)], "adamw", 2, 1.0, atol=1e-4)  # as Gemma 3's


@torch.no_grad()
def test_gemma2_critic_values_and_save_load_in_transformers(pool, gemma2, tmp_path):
    _critic_matches(pool, tmp_path / "critic", GEMMA2, 73, "Gemma2ForSequenceClassification")
    hf, src = gemma2
    config = _saves_and_loads_back(pool, hf, src, tmp_path / "a")
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (1.5, 2.0)


def test_gemma2_refusals_and_registry_shape():
    import transformers

    from realloc.models.config import get_model_config

    base = tiny_hf_config(**GEMMA2).to_dict()
    for patch, words in (({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping=-1.0"),
                         ({"final_logit_softcapping": "30"}, "final_logit_softcapping='30'"),
                         ({"attention_bias": True}, "attention_bias"),
                         ({"hidden_activation": "silu"}, "hidden_activation='silu'")):
        with pytest.raises(ValueError) as e:
            model_config_from_hf({**base, **patch})
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    cfg = get_model_config("gemma2-2b")
    hf = hf_config_from_model_config(cfg)
    kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    with torch.device("meta"):
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**kw))
    assert cfg.total_params == sum(p.numel() for p in model.parameters()) == 2_614_341_888
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert model_config_from_hf(hf, name="gemma2-2b") == cfg


def test_gemma_registry_types_plan(tmp_path):
    """The estimator's one-layer models keep a layer pattern's first layers (``ModelConfig.with_layers``), so
    ``realloc search`` plans GRPO with gemma3-1b and gemma2-2b (it stopped on their full-attention layers)."""
    import subprocess
    import sys
    from pathlib import Path

    from realloc.models.config import get_model_config

    one = get_model_config("gemma3-1b").with_layers(6)
    assert (one.n_layers, one.full_attention_layers, one.sliding_window) == (6, (5,), 512)
    src = (Path(__file__).parents[1] / "experiments" / "grpo_7b_7b.py").read_text()
    for actor in ("gemma3-1b", "gemma2-2b"):
        exp = tmp_path / f"grpo_{actor.replace('-', '_').replace('.', '_')}.py"
        exp.write_text(src.replace('actor="llama3-8b", reward="llama3-8b-critic"',
                                   f'actor="{actor}", reward="{actor}-critic"'))
        r = subprocess.run([sys.executable, "-m", "realloc", "search", str(exp), "--search-time", "0.5"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "searched" in r.stdout, r.stderr


def test_gemma_settings_cannot_be_written_as_another_family():
    """A hand-made config with Gemma 2/3 settings under a family whose config.json cannot say them is refused when
    written, rather than saved as a checkpoint transformers would run differently."""
    import dataclasses

    from realloc.models.config import get_model_config

    g2 = get_model_config("gemma2-2b")
    for family, field in (("gemma3_text", "attn_logit_softcapping"), ("gemma", "query_pre_attn_scalar")):
        cfg = dataclasses.replace(g2, family=family, sandwich_norms=family == "gemma3_text",
                                  qk_norm=family == "gemma3_text", sliding_window=None)
        with pytest.raises(ValueError, match=f"{field}=.* cannot be written as a {family} checkpoint"):
            hf_config_from_model_config(cfg)
