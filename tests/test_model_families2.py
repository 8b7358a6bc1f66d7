"""Per-layer sliding windows (Qwen2, Qwen3) and Phi-3 against HuggingFace transformers.

Tiny random models are built from their transformers config classes with a seed, saved with save_pretrained and
loaded into (tp, pp) layouts on 4 gloo processes (one pool for the module): logits, log-probs, entropies and greedy
tokens equal the dense HF model's, critic values its sequence classifier's, train steps its gradients, and saved
checkpoints load back in transformers with equal logits.

- Qwen2 with ``use_sliding_window`` and ``max_window_layers`` = 2 of 4 layers (layers 2 and 3 windowed, 5 tokens);
  Qwen3 with an explicit alternating ``layer_types`` (6 tokens). Rows of 16 tokens and generations of 19 go past
  the windows; a test shows the windows change transformers' logits, so the comparisons are not vacuous.
"""

from __future__ import annotations

import json

import pytest
import torch

from realloc.models.hf_io import hf_config_from_model_config, model_config_from_hf
from realloc.models.param_layout import param_specs
from model_helpers import assemble, tiny_hf_config, tiny_hf_model
from mp_pool import GlooPool
from test_model_hf import _check_against_hf, _critic_values, _padded_batch, _save
from test_model_train import _check_train

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp)
ALTERNATING = ["sliding_attention", "full_attention"] * 2
WINDOWS = {  # family -> the config.json keys of its windows, and (window, full-attention layers) realloc reads
    "qwen2": ({"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}, (5, (0, 1))),
    "qwen3": ({"use_sliding_window": True, "sliding_window": 6, "layer_types": ALTERNATING}, (6, (1, 3))),
}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _windowed(tmp_path_factory, family: str, seed: int):
    path = tmp_path_factory.mktemp(f"hf_{family}_windows")
    extra = {"head_dim": 32} if family == "qwen3" else {}
    return tiny_hf_model(path, seed=seed, family=family, kv_heads=2, **extra, **WINDOWS[family][0]), path


@pytest.fixture(scope="module")
def qwen2w(tmp_path_factory):
    return _windowed(tmp_path_factory, "qwen2", 31)


@pytest.fixture(scope="module")
def qwen3w(tmp_path_factory):
    return _windowed(tmp_path_factory, "qwen3", 32)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@torch.no_grad()
def test_per_layer_windows_change_transformers_logits_and_are_read(family, request):
    """The windows bind: the same weights with full attention everywhere give other logits past the window.
    realloc reads the window and which layers attend fully, and counts transformers' parameters."""
    import copy

    hf, path = request.getfixturevalue(family + "w")
    window, full = WINDOWS[family][1]
    cfg = model_config_from_hf(path)
    assert (cfg.sliding_window, cfg.full_attention_layers) == (window, full)
    assert [cfg.windowed(i) for i in range(4)] == [i not in full for i in range(4)]
    assert cfg.total_params == sum(p.numel() for p in hf.parameters())
    ids, _, mask = _padded_batch()
    plain = copy.deepcopy(hf)
    plain.config.layer_types = ["full_attention"] * 4
    plain.model.has_sliding_layers = False
    for layer in plain.model.layers:
        layer.self_attn.sliding_window = None
        layer.attention_type = "full_attention"
    a, b = hf(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a[:, :window], b[:, :window])
    assert (a[0, window:12] - b[0, window:12]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@torch.no_grad()
def test_per_layer_windows_match_hf_logits_and_greedy(pool, family, request):
    """Forward passes (right-padded and packed rows) and generation with KV caches from left-padded prompts."""
    hf, path = request.getfixturevalue(family + "w")
    _check_against_hf(pool, hf, path, LAYOUTS + ([(2, 2)] if family == "qwen3" else []))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_per_layer_windows_train_like_the_dense_model(pool, family, request):
    """SGD at lr 1 at tp 2 (sequence parallel) and pp 2 (every gradient checked); AdamW over two steps at tp 2 /
    pp 2."""
    hf, path = request.getfixturevalue(family + "w")
    _check_train(pool, hf, path, [(1, 2, 1), (1, 1, 2)], "sgd", 1, None)
    if family == "qwen3":
        _check_train(pool, hf, path, [(1, 2, 2)], "adamw", 2, 1.0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@torch.no_grad()
def test_per_layer_window_critics_match_the_sequence_classifier(pool, tmp_path, family):
    extra = {"head_dim": 32} if family == "qwen3" else {}
    hf = tiny_hf_model(tmp_path, seed=33, critic=True, family=family, kv_heads=2, **extra, **WINDOWS[family][0])
    cfg = model_config_from_hf(tmp_path)
    assert cfg.is_critic and cfg.sliding_window == WINDOWS[family][1][0]
    ids, lens, mask = _padded_batch(seed=5)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        last = pool.run(_critic_values, cfg, tp, pp, str(tmp_path), ids, lens)[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (family, tp, pp, (last - ref).abs().max())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@torch.no_grad()
def test_per_layer_windows_save_and_load_in_transformers(pool, family, tmp_path, request):
    from transformers import AutoModelForCausalLM

    hf, src = request.getfixturevalue(family + "w")
    cfg = model_config_from_hf(src)
    saved = assemble(pool.run(_save, cfg, 1, 2, 2, str(src), str(tmp_path / "a"), 4 << 30), cfg)
    hf_state = hf.state_dict()
    assert set(saved) == set(hf_state) and all(torch.equal(t, hf_state[n]) for n, t in saved.items())
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["layer_types"] == list(hf.config.layer_types) and config["use_sliding_window"] is True
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    assert list(back.config.layer_types) == list(hf.config.layer_types)
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)
    assert model_config_from_hf(tmp_path / "a") == cfg


def test_per_layer_windows_as_transformers_decides_them():
    """What transformers runs is read; what it ignores reads as full attention; what it refuses is one line."""
    base = {k: v for k, v in tiny_hf_config(family="qwen2").to_dict().items() if k != "layer_types"}
    read = lambda **kw: model_config_from_hf({**base, **kw})  # noqa: E731
    assert read(use_sliding_window=True, sliding_window=8, max_window_layers=1).full_attention_layers == (0,)
    # use_sliding_window false: Qwen2Config nulls the window, every layer attends fully
    assert read(use_sliding_window=False, sliding_window=8, max_window_layers=1).sliding_window is None
    # max_window_layers >= layers: no windowed layer
    assert read(use_sliding_window=True, sliding_window=8, max_window_layers=4).sliding_window is None
    # a window as long as the positions never binds
    assert read(use_sliding_window=True, sliding_window=256, max_window_layers=0).sliding_window is None
    every = read(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 4)
    assert (every.sliding_window, every.full_attention_layers) == (8, ())
    for kw, words in (({"layer_types": ["sliding_attention"] * 4}, "layer_types='sliding_attention'"),
                      ({"use_sliding_window": True, "layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
                      ({"use_sliding_window": True, "layer_types": ["full_attention"] * 3}, "one per layer"),
                      ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 1}, "sliding_window=0")):
        with pytest.raises(ValueError) as e:
            read(**kw)
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_per_layer_window_configs_round_trip_and_refuse_what_cannot_be_written():
    import dataclasses

    for family in ("qwen2", "qwen3"):
        for critic in (False, True):
            cfg = model_config_from_hf(tiny_hf_config(family=family, critic=critic, **WINDOWS[family][0]).to_dict(),
                                       name="m")
            assert cfg.full_attention_layers == WINDOWS[family][1][1]
            assert model_config_from_hf(hf_config_from_model_config(cfg), name="m") == cfg
    qwen2 = model_config_from_hf(tiny_hf_config(family="qwen2", **WINDOWS["qwen2"][0]).to_dict(), name="m")
    with pytest.raises(ValueError, match="cannot be written as a mistral checkpoint .it windows every layer or none"):
        hf_config_from_model_config(dataclasses.replace(qwen2, family="mistral", qkv_bias=False))
    assert [s.name for s in param_specs(qwen2)] == [s.name for s in param_specs(dataclasses.replace(
        qwen2, sliding_window=None))]


# -- Phi-3 --------------------------------------------------------------------------------------------------------

PHI3 = {"partial_rotary_factor": 0.75, "sliding_window": 6}  # 12 of each head's 16 features rotated; a 6-token window


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_phi3")
    return tiny_hf_model(path, seed=41, family="phi3", kv_heads=2, **PHI3), path


@torch.no_grad()
def test_phi3_reads_its_shape_and_counts_its_parameters(phi3):
    """The fused tensors split into the model's q/k/v and gate/up by rows; the counts are transformers'; the
    partial rotary embedding and the window both change transformers' logits (neither comparison is vacuous)."""
    import copy

    from realloc.models.fused_names import hf_shapes, split_hf_state

    hf, path = phi3
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.rotary_dim, cfg.head_dim, cfg.sliding_window, cfg.qkv_bias) == ("phi3", 12, 16, 6, False)
    state = hf.state_dict()
    assert cfg.total_params == sum(p.numel() for p in hf.parameters()) == sum(s.numel for s in param_specs(cfg))
    assert hf_shapes(cfg) == {n: tuple(t.shape) for n, t in state.items()}
    ours = split_hf_state(cfg, state)
    assert set(ours) == {s.name for s in param_specs(cfg)}
    qkv = state["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(torch.cat([ours[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]), qkv)
    assert ours["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    ids, _, mask = _padded_batch()
    ref = hf(input_ids=ids, attention_mask=mask).logits
    full_rope = copy.deepcopy(hf)
    full_rope.config.rope_parameters["partial_rotary_factor"] = 1.0
    type(full_rope.model.rotary_emb).__init__(full_rope.model.rotary_emb, full_rope.config)
    assert (full_rope(input_ids=ids, attention_mask=mask).logits - ref).abs().max() > 1e-3
    no_window = copy.deepcopy(hf)
    no_window.config.sliding_window = None
    other = no_window(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(other[:, :6], ref[:, :6]) and (other[0, 6:12] - ref[0, 6:12]).abs().max() > 1e-3


@torch.no_grad()
def test_phi3_matches_hf_logits_and_greedy(pool, phi3):
    hf, path = phi3
    _check_against_hf(pool, hf, path, LAYOUTS + [(2, 2), (4, 1)])


def test_phi3_trains_like_the_dense_model(pool, phi3):
    """SGD at lr 1 at tp 2 (sequence parallel), tp 4 and pp 2; AdamW over two steps at tp 2 / pp 2: the fused
    tensors' gradients, split by rows, are the model's."""
    hf, path = phi3
    _check_train(pool, hf, path, [(1, 2, 1), (1, 4, 1), (1, 1, 2)], "sgd", 1, None)
    _check_train(pool, hf, path, [(1, 2, 2)], "adamw", 2, 1.0)


@torch.no_grad()
def test_phi3_critic_values_match_its_sequence_classifier(pool, tmp_path):
    hf = tiny_hf_model(tmp_path, seed=43, critic=True, family="phi3", kv_heads=2, **PHI3)
    assert type(hf).__name__ == "Phi3ForSequenceClassification"
    cfg = model_config_from_hf(tmp_path)
    assert cfg.is_critic and cfg.family == "phi3"
    ids, lens, mask = _padded_batch(seed=5)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        last = pool.run(_critic_values, cfg, tp, pp, str(tmp_path), ids, lens)[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (tp, pp, (last - ref).abs().max())


@pytest.mark.parametrize("max_file_bytes", [4 << 30, 40_000], ids=["one-file-per-stage", "small-files"])
@torch.no_grad()
def test_phi3_saves_fused_tensors_that_load_in_transformers(pool, phi3, tmp_path, max_file_bytes):
    """Saved at tp 2 / pp 2 (files split between tensors, never inside a fused one): the files hold transformers'
    tensor names and values, load in transformers with equal logits, and read back to the same config."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf, src = phi3
    cfg = model_config_from_hf(src)
    pool.run(_save, cfg, 1, 2, 2, str(src), str(tmp_path / "a"), max_file_bytes)
    files = sorted((tmp_path / "a").glob("*.safetensors"))
    assert len(files) > (2 if max_file_bytes < 1 << 20 else 1)
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            state.update({k: fh.get_tensor(k) for k in fh.keys()})
    hf_state = hf.state_dict()
    assert set(state) == set(hf_state) and all(torch.equal(t, hf_state[n]) for n, t in state.items())
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["sliding_window"] == 6
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    assert type(back) is type(hf) and back.config.rope_parameters["partial_rotary_factor"] == 0.75
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)
    assert model_config_from_hf(tmp_path / "a") == cfg


def test_phi3_refuses_longrope_and_what_transformers_refuses_in_one_line():
    base = tiny_hf_config(family="phi3").to_dict()
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64}
    for patch, words in (({"rope_parameters": longrope}, "rope_type='longrope'"),
                         ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8}}, "rope_type='su'"),
                         ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
                         ({"sliding_window": 0}, "sliding_window=0"),
                         ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.2}}, "partial_rotary_factor")):
        with pytest.raises(ValueError) as e:
            model_config_from_hf({**base, **patch})
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    # the top-level key counts when rope_parameters has none, as Phi3Config reads it
    top = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "partial_rotary_factor": 0.5}
    assert model_config_from_hf(top).rotary_dim == 8
    for critic in (False, True):
        cfg = model_config_from_hf(tiny_hf_config(family="phi3", critic=critic, **PHI3).to_dict(), name="m")
        assert model_config_from_hf(hf_config_from_model_config(cfg), name="m") == cfg


# -- planning: registry shapes, realloc show ----------------------------------------------------------------------


def test_phi3_mini_registry_shape_has_the_parameters_of_transformers():
    """The planning shape of Phi-3-mini-4k against the parameters transformers allocates for its config.json (on
    the meta device), its config round trip, and the estimator's count of its parameters."""
    import transformers

    from realloc.estimator.memory import local_params
    from realloc.models.config import get_model_config

    cfg = get_model_config("phi3-mini")
    hf = hf_config_from_model_config(cfg)
    assert (hf["sliding_window"], hf["architectures"]) == (2047, ["Phi3ForCausalLM"])
    kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw))
    assert cfg.total_params == sum(p.numel() for p in model.parameters()) == 3_821_079_552
    assert model_config_from_hf(hf, name="phi3-mini") == cfg
    assert sum(local_params(cfg, 1, 2, s) for s in range(2)) == cfg.allocated_params == cfg.total_params


def test_show_names_phi3_and_per_layer_windows(tmp_path):
    from test_experiment_models import _experiment, _show

    f = _experiment(tmp_path)
    tiny_hf_model(tmp_path / "ckpt/sft", seed=1, family="phi3", kv_heads=2, **PHI3)
    tiny_hf_model(tmp_path / "ckpt/rm", seed=2, family="qwen2", kv_heads=2, critic=True, **WINDOWS["qwen2"][0])
    r = _show(f)
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":")[0]: ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint ")}
    assert "phi3, 4 layers, hidden 64, 4 heads (2 KV) x 16, MLP 176, vocabulary 128, sliding window 6, rotary 12 " \
        "of 16 features, 201,280 parameters" in lines["checkpoint actor"], lines
    assert "qwen2, 4 layers" in lines["checkpoint reward"] and "sliding window 5 in 2 of 4 layers" in \
        lines["checkpoint reward"]


# -- Gemma --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gemma")
    return tiny_hf_model(path, seed=51, family="gemma", kv_heads=2, head_dim=32, tie=True), path


@torch.no_grad()
def test_gemma_reads_its_shape_and_each_difference_from_llama_matters(gemma):
    """head_dim 32 (not 16), tied embeddings, gelu: read; the (1 + w) norms are random (HF's zeros would show
    little), and the gelu MLP and the embedding scale each change transformers' logits."""
    import copy

    hf, path = gemma
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.head_dim, cfg.tie_embeddings, cfg.hidden_act, cfg.norm_plus_one, cfg.embed_scale) == \
        ("gemma", 32, True, "gelu_pytorch_tanh", True, True)
    assert cfg.total_params == sum(p.numel() for p in hf.parameters()) == sum(s.numel for s in param_specs(cfg))
    ids, _, mask = _padded_batch()
    ref = hf(input_ids=ids, attention_mask=mask).logits
    silu = copy.deepcopy(hf)
    for layer in silu.model.layers:
        layer.mlp.act_fn = torch.nn.SiLU()
    unscaled = copy.deepcopy(hf)
    unscaled.model.embed_tokens.embed_scale.fill_(1.0)
    for other in (silu, unscaled):
        assert (other(input_ids=ids, attention_mask=mask).logits - ref).abs().max() > 1e-3


@torch.no_grad()
def test_gemma_matches_hf_logits_and_greedy(pool, gemma):
    hf, path = gemma
    _check_against_hf(pool, hf, path, LAYOUTS + [(2, 2)])


def test_gemma_trains_like_the_dense_model(pool, gemma):
    """SGD at lr 1 at tp 2 (sequence parallel) and pp 2 (the tied embedding's gradient summed over both stages,
    the (1 + w) norms' gradients); AdamW over two steps at tp 2 / pp 2."""
    hf, path = gemma
    _check_train(pool, hf, path, [(1, 2, 1), (1, 1, 2)], "sgd", 1, None)
    _check_train(pool, hf, path, [(1, 2, 2)], "adamw", 2, 1.0)


@torch.no_grad()
def test_gemma_critic_values_match_its_sequence_classifier(pool, tmp_path):
    hf = tiny_hf_model(tmp_path, seed=53, critic=True, family="gemma", kv_heads=2, head_dim=32)
    assert type(hf).__name__ == "GemmaForSequenceClassification"
    cfg = model_config_from_hf(tmp_path)
    assert cfg.is_critic and not cfg.tie_embeddings
    ids, lens, mask = _padded_batch(seed=5)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        last = pool.run(_critic_values, cfg, tp, pp, str(tmp_path), ids, lens)[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (tp, pp, (last - ref).abs().max())


@torch.no_grad()
def test_gemma_saves_and_loads_in_transformers(pool, gemma, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, src = gemma
    cfg = model_config_from_hf(src)
    saved = assemble(pool.run(_save, cfg, 1, 2, 2, str(src), str(tmp_path / "a"), 4 << 30), cfg)
    hf_state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding's
    assert set(saved) == set(hf_state) and all(torch.equal(t, hf_state[n]) for n, t in saved.items())
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["architectures"], config["hidden_act"]) == (["GemmaForCausalLM"], "gelu_pytorch_tanh")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)
    assert model_config_from_hf(tmp_path / "a") == cfg


def test_gemma_refusals_and_registry_shapes():
    import transformers

    from realloc.models.config import get_model_config

    base = tiny_hf_config(family="gemma", head_dim=32).to_dict()
    assert model_config_from_hf({**base, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"  # GemmaConfig's
    for patch, words in (({"hidden_act": "relu"}, "hidden_act='relu'"), ({"attention_bias": True}, "attention_bias"),
                         ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                         ({"model_type": "gemma3"}, "model_type='gemma3'")):
        with pytest.raises(ValueError) as e:
            model_config_from_hf({**base, **patch})
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    for name, count in (("gemma-2b", 2_506_172_416), ("gemma-7b", 8_537_680_896)):
        cfg = get_model_config(name)
        hf = hf_config_from_model_config(cfg)
        kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
        with torch.device("meta"):
            model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**kw))
        assert cfg.total_params == sum(p.numel() for p in model.parameters()) == count, name
        assert model_config_from_hf(hf, name=name) == cfg


def test_gemma_rmsnorm_is_transformers_bit_for_bit_in_bf16_and_its_gradients_are_autograds():
    """(1 + w) multiplied in fp32 before the cast to bf16, as GemmaRMSNorm; a LLaMA-order norm with w + 1 folded into
    its weight rounds otherwise. The hand-written backward equals autograd through transformers' formula (fp64)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from realloc.models.llama import RMSNorm

    torch.manual_seed(0)
    theirs = GemmaRMSNorm(64, eps=1e-6)
    ours = RMSNorm(64, 1e-6, torch.bfloat16, torch.device("cpu"), plus_one=True)
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.3)
        ours.weight.copy_(theirs.weight.to(torch.bfloat16))
        theirs.weight.copy_(ours.weight.float())
    x = torch.randn(3, 5, 64).to(torch.bfloat16) * 3
    with torch.no_grad():
        want = theirs.to(torch.bfloat16)(x)
        assert torch.equal(ours(x), want)
        folded = RMSNorm(64, 1e-6, torch.bfloat16, torch.device("cpu"))
        folded.weight.copy_(ours.weight.float() + 1)
        assert not torch.equal(folded(x), want)
    # transformers' formula in fp64 (GemmaRMSNorm itself computes in fp32)
    w = (torch.randn(64, dtype=torch.float64) * 0.3).requires_grad_(True)
    mine = RMSNorm(64, 1e-6, torch.float64, torch.device("cpu"), plus_one=True)
    with torch.no_grad():
        mine.weight.copy_(w)
    xa = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    xb = xa.detach().clone().requires_grad_(True)
    dy = torch.randn(4, 64, dtype=torch.float64)
    ((xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)) * dy).sum().backward()
    (mine(xb) * dy).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine.weight.grad, w.grad, rtol=1e-12, atol=1e-12)


def _bf16_outputs(ctx, cfg, tp, path, ids):
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.models.hf_io import load_hf_checkpoint
    from realloc.strategy import ParallelStrategy

    layout = ModelLayout.for_model(cfg, tuple(range(tp)), ParallelStrategy(1, tp, 1))
    ctx.groups.ensure_layouts([layout])
    if ctx.rank >= tp:
        return None
    model = ParallelModel(cfg, ctx.groups.model_groups(layout), dtype=torch.bfloat16, init="empty")
    load_hf_checkpoint(model, path)
    with torch.no_grad():
        return model.stage.embed(ids), model.stage.model.norm(model.stage.embed(ids))


@torch.no_grad()
def test_gemma_bf16_embedding_scale_and_norm_are_transformers_bit_for_bit(pool, tmp_path):
    """hidden 48: sqrt(48) = 6.928 rounds to 6.9375 in bf16, as GemmaTextScaledWordEmbedding scales; realloc's
    bf16 embeddings (tp 1 and tp 2) and its final norm over them equal transformers' in bf16 bit for bit, and an
    fp32 scale would not."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(61)
    hf = GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        hf.model.norm.weight.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    hf = hf.to(torch.bfloat16)
    ids = torch.randint(1, 128, (2, 9))
    cfg = model_config_from_hf(tmp_path)
    want = hf.model.embed_tokens(ids)
    exact = hf.model.embed_tokens.weight[ids] * (48 ** 0.5)
    assert not torch.equal(want, exact)  # the rounding of the scale shows
    for tp in (1, 2):
        emb, normed = pool.run(_bf16_outputs, cfg, tp, str(tmp_path), ids)[0]
        assert emb.dtype == torch.bfloat16 and torch.equal(emb, want), tp
        assert torch.equal(normed, hf.model.norm(want)), tp


def test_lora_on_gemma_trains_like_the_dense_lora_formula(pool, gemma):
    """LoRA adapters on every projection of a Gemma model (the (1 + w) norms and the scaled tied embedding frozen)
    take the dense model's SGD step at tp 1 and tp 2."""
    import dataclasses

    from test_lora import LORA, DenseLoRA, _adapters, _assemble_adapters, _micro_batches, _train

    hf, path = gemma
    cfg = dataclasses.replace(model_config_from_hf(path), lora=LORA)
    adapters = _adapters(cfg, seed=3)
    mbs = _micro_batches(seed=11)
    dense = DenseLoRA(hf, LORA, adapters)
    ref_norm = dense.sgd_step(mbs, max_norm=0.05)
    for tp in (1, 2):
        res = [r for r in pool.run(_train, cfg, 1, tp, 1, str(path), adapters, mbs, 0.05, False, True) if r is not None]
        for r in res:
            assert r["frozen_moved"] == [] and abs(r["stats"]["grad_norm"] - ref_norm) < 1e-5 * max(1.0, ref_norm)
        for name, t in _assemble_adapters(res, cfg).items():
            assert (t - dense.params[name].detach()).abs().max().item() < 2e-6, (tp, name)
