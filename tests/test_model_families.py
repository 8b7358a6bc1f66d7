"""Qwen3 and Mistral checkpoints against HuggingFace transformers, and the families realloc refuses.

Tiny random Qwen3ForCausalLM / MistralForCausalLM models (and their sequence classifiers) are built from their
transformers config classes with a seed, saved with save_pretrained and loaded into (tp, pp) layouts on 4 gloo
processes: logits, log-probs, entropies and greedy tokens equal the dense HF model's in the test process, at
tp 1 / pp 1 (one process) as at tp 2, pp 2, both, and tp 4 (Qwen3's 2 KV heads, each with its k_norm, shared by
2 ranks). Qwen3's q_norm / k_norm weights are random (HF starts them at one, which would not show a head
normalized with the wrong weight), and its head_dim (32) is not hidden / heads (16). Train steps match the dense
model's gradients with and without sequence parallelism (the per-head norms' gradients are partial sums over a
rank's heads). Saved checkpoints load in transformers with equal logits.
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
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen3")
    return tiny_hf_model(path, seed=21, family="qwen3", kv_heads=2, head_dim=32), path


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    # a window as long as the positions: it never binds, so transformers' sliding mask is the causal one
    path = tmp_path_factory.mktemp("hf_mistral")
    return tiny_hf_model(path, seed=22, family="mistral", kv_heads=2, sliding_window=256), path


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
    hf, path = request.getfixturevalue(which)
    assert model_config_from_hf(path).family == which
    _check_against_hf(pool, hf, path, layouts)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@torch.no_grad()
def test_critic_values_match_the_families_sequence_classifier(pool, tmp_path, family):
    hf = tiny_hf_model(tmp_path, seed=23, critic=True, family=family, kv_heads=2)
    assert type(hf).__name__ == {"qwen3": "Qwen3", "mistral": "Mistral"}[family] + "ForSequenceClassification"
    cfg = model_config_from_hf(tmp_path)
    assert cfg.is_critic and cfg.family == family
    ids, lens, mask = _padded_batch(seed=5)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    for tp, pp in [(1, 1), (2, 2), (4, 1)]:
        last = pool.run(_critic_values, cfg, tp, pp, str(tmp_path), ids, lens)[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (family, tp, pp, (last - ref).abs().max())


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_qwen3_train_steps_match_the_dense_model(pool, qwen3, sequence_parallel):
    """SGD at lr 1 (weights = w - grad, every gradient checked, q_norm and k_norm included) at tp 2 and at tp 4,
    where each KV head and its k_norm input are on 2 ranks; AdamW over two steps at tp 2 / pp 2."""
    hf, path = qwen3
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
    assert config["sliding_window"] is None  # Mistral's window never bound; Qwen3's layers are full attention
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)
    assert model_config_from_hf(tmp_path / "a") == cfg


@torch.no_grad()
def test_a_mistral_window_shorter_than_the_positions_is_refused_and_would_differ():
    """A window of 8 tokens over 256 positions: transformers' logits on a 16-token sequence differ from full
    attention's (so running it as full attention would be wrong), and realloc refuses it in one line naming
    sliding_window; a null window, or one of at least max_position_embeddings, loads."""
    import transformers

    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for window in (8, None):
        torch.manual_seed(0)
        hf = transformers.MistralForCausalLM(tiny_hf_config(family="mistral", sliding_window=window)).eval()
        logits[window] = hf(input_ids=ids).logits
    assert torch.equal(logits[8][:, :8], logits[None][:, :8])  # the window binds from token 9 on
    assert not torch.allclose(logits[8][:, 8:], logits[None][:, 8:], atol=1e-3)
    base = tiny_hf_config(family="mistral").to_dict()
    for window, ok in ((8, False), (255, False), (None, True), (256, True), (4096, True)):
        hf = {**base, "sliding_window": window}
        if ok:
            assert model_config_from_hf(hf).family == "mistral"
            continue
        with pytest.raises(ValueError) as e:
            model_config_from_hf(hf)
        assert "\n" not in str(e.value) and f"sliding_window={window} is not supported" in str(e.value)
        assert "max_position_embeddings=256" in str(e.value)
    # MistralConfig's default window (4096) applies when config.json omits the key
    with pytest.raises(ValueError, match="sliding_window=4096 is not supported .config.json omits it"):
        model_config_from_hf({k: v for k, v in base.items() if k != "sliding_window"} |
                             {"max_position_embeddings": 32768})


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
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type='gemma'"),
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}, "model_type='phi3'"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "gelu_pytorch_tanh"},
     "hidden_act='gelu_pytorch_tanh'"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=True"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 16, "max_window_layers": 1}, "use_sliding_window=True"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding_window=64"),
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
    tiny_hf_model(tmp_path / "ckpt/rm", seed=2, family="mistral", kv_heads=2, critic=True, sliding_window=None)
    r = _show(f)
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":")[0]: ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint ")}
    assert "qwen3, 4 layers, hidden 64, 4 heads (2 KV) x 32, MLP 176, vocabulary 128, q/k head norms, 250,688 " \
        "parameters" in lines["checkpoint actor"]
    assert "(new value head): qwen3" in lines["checkpoint critic"] and "value head, 242,560" in lines["checkpoint critic"]
    assert "mistral, 4 layers" in lines["checkpoint reward"] and "value head" in lines["checkpoint reward"]
