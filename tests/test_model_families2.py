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
    """SGD at lr 1 at tp 2 (sequence parallel) and pp 2 (every gradient checked); AdamW over two steps at tp 2 / pp 2."""
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
