"""Qwen3 and Mistral checkpoints against HuggingFace transformers, and the families realloc refuses.

Tiny random Qwen3ForCausalLM / MistralForCausalLM models (and their sequence classifiers) are built from their
transformers config classes with a seed, saved with save_pretrained and loaded into (tp, pp) layouts on 4 gloo
processes: logits, log-probs, entropies and greedy tokens equal the dense HF model's in the test process, at
tp 1 / pp 1 (one process) as at tp 2, pp 2, both, and tp 4 (Qwen3's 2 KV heads, each with its k_norm, shared by
2 ranks). Qwen3's q_norm / k_norm weights are random (HF starts them at one, which would not show a head
normalized with the wrong weight), and its head_dim (32) is not hidden / heads (16). Mistral's sliding window
(6 tokens) binds on these rows and generations. Train steps match the dense model's gradients with and without
sequence parallelism (Qwen3's per-head norms' gradients are partial sums over a rank's heads). Saved checkpoints
load in transformers with equal logits.
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
from test_multiturn import tokenizer_dir  # noqa: F401 (the fixture: the tiny character tokenizer)

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen3")
    return tiny_hf_model(path, seed=21, family="qwen3", kv_heads=2, head_dim=32), path


WINDOW = 6  # Mistral's sliding window in these tests: the 16-token rows and 19-token generations go past it


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_mistral")
    return tiny_hf_model(path, seed=22, family="mistral", kv_heads=2, sliding_window=WINDOW), path


@torch.no_grad()
def test_qwen3_reads_its_shape_and_counts_its_parameters(qwen3):
    hf, path = qwen3
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.q_dim, cfg.rope_theta) == \
        ("qwen3", True, False, 32, 128, 1e6)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert cfg.total_params == n_hf == sum(s.numel for s in param_specs(cfg))
    assert {s.name for s in param_specs(cfg)} == set(hf.state_dict())
    # Qwen3Config's head_dim when config.json omits it is 128, not hidden / heads
    raw = json.loads((path / "config.json").read_text())
    del raw["head_dim"]
    assert model_config_from_hf(raw).head_dim == 128


@pytest.mark.parametrize("which,layouts", [("qwen3", LAYOUTS + [(4, 1)]), ("mistral", LAYOUTS)])
@torch.no_grad()
def test_qwen3_and_mistral_match_hf_logits_and_greedy_in_every_layout(pool, which, layouts, request):
    """Mistral's window of 6 tokens binds: forward passes (right-padded and packed rows), generation with KV caches
    from left-padded prompts, at every layout."""
    hf, path = request.getfixturevalue(which)
    cfg = model_config_from_hf(path)
    assert cfg.family == which and cfg.sliding_window == (WINDOW if which == "mistral" else None)
    _check_against_hf(pool, hf, path, layouts)


@torch.no_grad()
def test_the_mistral_window_changes_transformers_logits(mistral):
    """Not a vacuous comparison: the same weights without the window give other logits past token 6."""
    import copy

    hf, _ = mistral
    ids, _, mask = _padded_batch()
    full = copy.deepcopy(hf)
    full.config.sliding_window = None
    windowed, plain = hf(input_ids=ids, attention_mask=mask).logits, full(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(windowed[:, :WINDOW], plain[:, :WINDOW])
    assert (windowed[0, WINDOW:12] - plain[0, WINDOW:12]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@torch.no_grad()
def test_critic_values_match_the_families_sequence_classifier(pool, tmp_path, family):
    hf = tiny_hf_model(tmp_path, seed=23, critic=True, family=family, kv_heads=2,
                       **({"sliding_window": 5} if family == "mistral" else {}))
    assert type(hf).__name__ == {"qwen3": "Qwen3", "mistral": "Mistral"}[family] + "ForSequenceClassification"
    cfg = model_config_from_hf(tmp_path)
    assert cfg.is_critic and cfg.family == family
    ids, lens, mask = _padded_batch(seed=5)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    for tp, pp in [(1, 1), (2, 2), (4, 1)]:
        last = pool.run(_critic_values, cfg, tp, pp, str(tmp_path), ids, lens)[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (family, tp, pp, (last - ref).abs().max())


@pytest.mark.parametrize("which,sequence_parallel", [("qwen3", True), ("qwen3", False), ("mistral", True)])
def test_train_steps_match_the_dense_model(pool, which, sequence_parallel, request):
    """SGD at lr 1 (weights = w - grad, every gradient checked, Qwen3's q_norm and k_norm included) at tp 2 and at
    tp 4, where each KV head and its k_norm input are on 2 ranks; AdamW over two steps at tp 2 / pp 2. Mistral's
    rows of 4-13 tokens train under its 6-token window."""
    hf, path = request.getfixturevalue(which)
    _check_train(pool, hf, path, [(1, 2, 1), (1, 4, 1)], "sgd", 1, None, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        _check_train(pool, hf, path, [(1, 2, 2)], "adamw", 2, 1.0)


@pytest.mark.parametrize("which", ["qwen3", "mistral"])
@torch.no_grad()
def test_save_at_tp2_pp2_loads_in_transformers_with_equal_logits(pool, which, tmp_path, request):
    from transformers import AutoModelForCausalLM

    hf, src = request.getfixturevalue(which)
    cfg = model_config_from_hf(src)
    saved = assemble(pool.run(_save, cfg, 1, 2, 2, str(src), str(tmp_path / "a"), 4 << 30), cfg)
    hf_state = hf.state_dict()
    assert set(saved) == set(hf_state)
    for name, t in saved.items():
        assert torch.equal(t, hf_state[name]), name
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == which and config["architectures"] == [type(hf).__name__]
    assert config["sliding_window"] == (WINDOW if which == "mistral" else None)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)
    assert model_config_from_hf(tmp_path / "a") == cfg


def test_mistral_windows_as_transformers_reads_them():
    """A window of at least max_position_embeddings never binds (read as none), an absent key is MistralConfig's
    4096, and a window that is no number of tokens is one line naming the field."""
    base = tiny_hf_config(family="mistral").to_dict()  # 256 positions
    for window, want in ((8, 8), (255, 255), (None, None), (256, None), (4096, None)):
        assert model_config_from_hf({**base, "sliding_window": window}).sliding_window == want
    absent = {k: v for k, v in base.items() if k != "sliding_window"}
    assert model_config_from_hf({**absent, "max_position_embeddings": 32768}).sliding_window == 4096
    for bad in (0, -3, "4096", True):
        with pytest.raises(ValueError) as e:
            model_config_from_hf({**base, "sliding_window": bad})
        assert "\n" not in str(e.value) and f"sliding_window={bad!r} is not supported" in str(e.value)


def test_qwen3_and_mistral_configs_round_trip():
    for family in ("qwen3", "mistral"):
        for critic in (False, True):
            cfg = model_config_from_hf(tiny_hf_config(family=family, critic=critic).to_dict(), name="m")
            back = model_config_from_hf(hf_config_from_model_config(cfg), name="m")
            assert back == cfg and back.qk_norm == (family == "qwen3")
    qwen3 = model_config_from_hf(tiny_hf_config(family="qwen3").to_dict(), name="m")
    import dataclasses
    with pytest.raises(ValueError, match="qk_norm=False cannot be written as a qwen3 checkpoint"):
        hf_config_from_model_config(dataclasses.replace(qwen3, qk_norm=False))
    with pytest.raises(ValueError, match="qk_norm=True cannot be written as a llama checkpoint"):
        hf_config_from_model_config(dataclasses.replace(qwen3, family="llama"))
    mistral = model_config_from_hf(tiny_hf_config(family="mistral", sliding_window=8).to_dict(), name="m")
    assert hf_config_from_model_config(mistral)["sliding_window"] == 8
    with pytest.raises(ValueError, match="sliding_window=8 cannot be written as a llama checkpoint"):
        hf_config_from_model_config(dataclasses.replace(mistral, family="llama"))


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "mistral-7b"])
def test_registry_shapes_have_the_parameters_of_transformers_models(name):
    """The planning shapes of Qwen3-0.6B, Qwen3-8B and Mistral-7B-v0.3 against the parameters transformers
    allocates for their config.json (on the meta device: no memory), and their config round trip."""
    import transformers

    from realloc.models.config import get_model_config

    cfg = get_model_config(name)
    hf = hf_config_from_model_config(cfg)
    prefix = {"qwen3": "Qwen3", "mistral": "Mistral"}[cfg.family]
    kw = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    with torch.device("meta"):
        model = getattr(transformers, prefix + "ForCausalLM")(getattr(transformers, prefix + "Config")(**kw))
    assert cfg.total_params == sum(p.numel() for p in model.parameters())
    assert model_config_from_hf(hf, name=name) == cfg


def test_estimator_counts_the_head_norms_by_hand():
    """Qwen3-8B at tp 2: the q/k head norms read and write q/t + kvl per token (2 bytes each in bf16), two
    kernels more forward and four backward, and keep their inputs and 1/rms per head for the backward; a profile
    measured without them does not price a model with them."""
    import dataclasses

    from realloc.estimator import opcount as oc
    from realloc.estimator.hardware import Precision
    from realloc.estimator.profile_table import ModelArch
    from realloc.models.config import get_model_config

    bf16 = Precision.for_dtype("bf16")
    qwen3 = get_model_config("qwen3-8b")
    plain = dataclasses.replace(qwen3, qk_norm=False)
    assert qwen3.layer_params - plain.layer_params == 2 * 128
    n, q, kvl = 4 * 64, 32 * 128 // 2, 8 * 128 // 2  # tokens; the rank's q and kv width
    for phase, factor, kernels in ((oc.Phase.FWD, 1, 2), (oc.Phase.PREFILL, 1, 2), (oc.Phase.BWD, 2, 4)):
        a, b = (oc.op_work(c, oc.Part.BLOCK, phase, 2, 4, 64, bf16) for c in (qwen3, plain))
        assert a.elem_bytes - b.elem_bytes == factor * n * 2 * (q + kvl) * 2, phase
        assert (a.kernels - b.kernels, a.gemm_flops, a.attn_flops) == (kernels, b.gemm_flops, b.attn_flops)
    saved = oc.saved_activation_bytes_per_token(qwen3, 2, bf16) - oc.saved_activation_bytes_per_token(plain, 2, bf16)
    assert saved == (q + kvl) * 2 + (16 + 4) * 4
    # bf16 without grad: normalizing q holds q, its fp32 copy and square (5q), k and v: above rotary's 4q + 2kv
    assert oc.attention_working_bytes_per_token(qwen3, 2, bf16, sequence_parallel=False) == \
        (3 * 4096 + max(5 * q + 2 * kvl, q + 6 * kvl)) * 2
    assert ModelArch.of(qwen3) != ModelArch.of(plain) and ModelArch.of(plain).qk_norm is None


REPO_CONFIG = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
               "rms_norm_eps": 1e-6, "hidden_act": "silu"}


@pytest.mark.parametrize("patch,words", [
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}, "model_type='qwen3_moe'"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "model_type='gemma3'"),
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "su"}}, "rope_type='su'"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "gelu_pytorch_tanh"},
     "hidden_act='gelu_pytorch_tanh'"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=True"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False,
      "sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types='sliding_attention'"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window=0"),
])
def test_show_names_an_unsupported_family_or_field_in_one_line(tmp_path, patch, words):
    from test_experiment_models import _experiment, _show, _write_ckpt

    f = _experiment(tmp_path)
    _write_ckpt(tmp_path / "ckpt/sft", {**REPO_CONFIG, **patch})
    r = _show(f)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err and "ckpt/sft" in err and "Qwen3ForCausalLM" in err and "MistralForCausalLM" in err, err


def test_show_prints_the_family_and_shape_of_each_checkpoint(tmp_path):
    from test_experiment_models import _experiment, _show

    f = _experiment(tmp_path)
    tiny_hf_model(tmp_path / "ckpt/sft", seed=1, family="qwen3", kv_heads=2, head_dim=32)
    tiny_hf_model(tmp_path / "ckpt/rm", seed=2, family="mistral", kv_heads=2, critic=True, sliding_window=16)
    r = _show(f)
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":")[0]: ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint ")}
    assert "qwen3, 4 layers, hidden 64, 4 heads (2 KV) x 32, MLP 176, vocabulary 128, q/k head norms, 250,688 " \
        "parameters" in lines["checkpoint actor"]
    critic = lines["checkpoint critic"]
    assert "(new value head): qwen3" in critic and "value head, 242,560" in critic
    assert "mistral, 4 layers" in lines["checkpoint reward"] and "sliding window 16" in lines["checkpoint reward"]


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1)], ids=["one", "tp2"])
def test_a_sliding_window_keeps_multiturn_caches_exactly(pool, tokenizer_dir, layout):
    """Multi-turn rollouts of a model with a 5-token window (conversations of 3-30 tokens): keys kept across turns
    (slots with gaps, positions from each row's start) sample the tokens and log-probs of prefilling the whole
    conversation again, and those log-probs are a teacher-forced forward pass's (masks by positions both ways)."""
    import dataclasses

    from realloc.models.config import get_model_config
    from test_multiturn import ENV, _gathered, _generate

    cfg = dataclasses.replace(get_model_config("tiny"), name="tiny-window", family="mistral", sliding_window=5)
    again = _gathered(pool.run(_generate, tokenizer_dir, *layout, env={**ENV, "kv_cache": False}, cfg=cfg))
    kept = _gathered(pool.run(_generate, tokenizer_dir, *layout, env=ENV, cfg=cfg))
    for k in ("tokens", "gen_mask", "loss_mask"):
        assert torch.equal(kept[k], again[k]), k
    assert kept["sums"][0]["cached_tokens"] > 0 and int(kept["gen_mask"].sum(1).max()) > 2 * 5
    torch.testing.assert_close(kept["logp"], again["logp"], rtol=0, atol=1e-6)
    mask = kept["loss_mask"]
    torch.testing.assert_close(kept["logp"][mask], kept["forced"][mask], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 2, 1, 2)], ids=["one", "tp2-2mbs"])
def test_the_static_decode_step_keeps_a_sliding_window(pool, layout):
    """The fixed-shape decode step (the one a CUDA graph replays; its slot is a device tensor) under a 4-token
    window gives the eager loop's tokens and log-probs (the eager loop is transformers', above)."""
    import dataclasses

    from realloc.models.config import get_model_config
    from realloc.models.sampling import GenerationConfig
    from test_static_decode import _by_replica, _generate, _prompts

    cfg = dataclasses.replace(get_model_config("tiny-gqa"), name="tiny-window", family="mistral", sliding_window=4)
    base = dict(max_new_tokens=12, seed=5, greedy=False, temperature=0.8)
    dp, tp, pp, n_mbs = layout
    runs = {mode: _by_replica(pool.run(_generate, cfg, dp, tp, pp, _prompts(), GenerationConfig(**base, decode=mode),
                                       n_mbs)) for mode in ("eager", "static")}
    (seqs, logp, _), (ref_seqs, ref_logp, _) = runs["static"], runs["eager"]
    assert seqs == ref_seqs and min(map(len, seqs)) > 4
    for a, b in zip(logp, ref_logp):
        assert torch.allclose(a, b, atol=1e-5), (a, b)


def test_lora_on_qwen3_trains_like_the_dense_lora_formula(pool, qwen3):
    """LoRA adapters on every projection of a Qwen3 model (the head norms frozen, after q_proj's and k_proj's
    adapters as in PEFT) take the dense model's SGD step at tp 1, tp 2 (with and without sequence parallelism)
    and tp 4."""
    import dataclasses

    from test_lora import LORA, DenseLoRA, _adapters, _assemble_adapters, _micro_batches, _train

    hf, path = qwen3
    cfg = dataclasses.replace(model_config_from_hf(path), lora=LORA)
    adapters = _adapters(cfg, seed=3)
    mbs = _micro_batches(seed=11)
    dense = DenseLoRA(hf, LORA, adapters)
    ref_norm = dense.sgd_step(mbs, max_norm=0.05)
    for tp, sp in ((1, True), (2, True), (2, False), (4, True)):
        res = [r for r in pool.run(_train, cfg, 1, tp, 1, str(path), adapters, mbs, 0.05, False, sp) if r is not None]
        for r in res:
            assert r["frozen_moved"] == [] and abs(r["stats"]["grad_norm"] - ref_norm) < 1e-5 * max(1.0, ref_norm)
        for name, t in _assemble_adapters(res, cfg).items():
            assert (t - dense.params[name].detach()).abs().max().item() < 2e-6, (tp, sp, name)
