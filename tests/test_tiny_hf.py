"""The locally made HF assets: shipped text files, tokenizer training, and tiny checkpoints in transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_assets import CHECKPOINTS, CORPUS, MODEL_VOCAB, REPO
from realloc.tiny_assets import hf as tiny_hf
from realloc.tiny_assets import text as tiny_text


def test_shipped_text_files_are_the_generators_output(tmp_path):
    for f in tiny_text.write_all(tmp_path):
        assert f.read_bytes() == (REPO / "experiments" / "data" / f.name).read_bytes(), f.name
    assert 20_000 < CORPUS.stat().st_size < 100_000


def test_tokenizer_training_is_deterministic(hf_assets, tmp_path):
    again = tiny_hf.train_tokenizer(CORPUS, tmp_path / "tok", vocab_size=500)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (again / name).read_text() == (hf_assets.tokenizer / name).read_text()
    vocab = json.loads((again / "tokenizer.json").read_text())["model"]["vocab"]
    assert [vocab[t] for t in tiny_hf.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert " plus" in {t.replace("Ġ", " ") for t in vocab}  # merges learned from the corpus


def _weights(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_checkpoints_load_in_transformers_and_run(hf_assets, name):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    spec = hf_assets.spec(name)
    path = hf_assets.checkpoint(name)
    seqcls = spec.get("head") == "seqcls"
    cls = AutoModelForSequenceClassification if seqcls else AutoModelForCausalLM
    model = cls.from_pretrained(str(path)).eval()
    arch = {"llama": "Llama", "qwen2": "Qwen2"}[spec["arch"]]
    assert type(model).__name__ == arch + ("ForSequenceClassification" if seqcls else "ForCausalLM")
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.num_hidden_layers) == (
        MODEL_VOCAB, spec["kv_heads"], 8, 4)
    assert (cfg.pad_token_id, cfg.bos_token_id) == (0, 1)
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == ([2, 4], 0)
    weights = _weights(path)
    assert ("lm_head.weight" in weights) == (not seqcls and not spec.get("tie", False))
    for k, v in weights.items():  # norms and biases are random, not HF's 1 and 0
        if k.endswith("norm.weight") or k.endswith(".bias"):
            assert v.std() > 0.05, k
    assert any(k.endswith("q_proj.bias") for k in weights) == (spec["arch"] == "qwen2")
    # The copied tokenizer gives the same ids in the checkpoint (transformers loads it as Qwen2Tokenizer
    # in a Qwen2 directory) as in its own directory.
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    bare = AutoTokenizer.from_pretrained(str(hf_assets.tokenizer), local_files_only=True)
    for text in ("What is 13 plus 4?", "Ada's café: 1,024 apples!\n\n  Done."):
        assert tok(text)["input_ids"] == bare(text)["input_ids"]
    ids = torch.tensor([tok(t)["input_ids"][:9] for t in ("What is 3 plus 4 and 5?", "Hello there, Ada and Ben!")])
    with torch.no_grad():
        if seqcls:
            ids[1, 7:] = 0  # right padding: the score is read at the last non-pad token
            scores = model(ids).logits
            alone = model(ids[1:, :7]).logits
            assert scores.shape == (2, 1) and torch.allclose(scores[1], alone[0], atol=1e-5)
        else:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 eos_token_id=None)
            assert out.shape == (2, 15) and torch.equal(out[:, :9], ids)
            if spec.get("tie"):
                assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_checkpoints_are_deterministic_and_shard(hf_assets, tmp_path):
    spec = hf_assets.spec("llama")
    a = tiny_hf.make_tiny_checkpoint(tmp_path / "a", tokenizer_dir=hf_assets.tokenizer, **spec)
    b = _weights(hf_assets.checkpoint("llama"))
    assert len(list(a.glob("model-*.safetensors"))) > 1 and (a / "model.safetensors.index.json").is_file()
    wa = _weights(a)
    assert wa.keys() == b.keys() and all(torch.equal(wa[k], b[k]) for k in wa)
    c = _weights(tiny_hf.make_tiny_checkpoint(tmp_path / "c", **{**spec, "seed": 99, "max_shard_size": None}))
    assert not torch.equal(c["model.embed_tokens.weight"], wa["model.embed_tokens.weight"])
    before = torch.get_rng_state()
    tiny_hf.make_tiny_checkpoint(tmp_path / "d", layers=1)
    assert torch.equal(before, torch.get_rng_state())  # the caller's RNG is left alone


def test_realloc_reads_the_llama_checkpoints(hf_assets):
    from realloc.models.hf_io import model_config_from_hf

    cfg = model_config_from_hf(hf_assets.checkpoint("llama_gqa_tied"))
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.n_heads, cfg.tie_embeddings, cfg.is_critic) == (512, 2, 8, True, False)
    assert model_config_from_hf(hf_assets.checkpoint("llama_reward")).is_critic


def test_command_line(tmp_path, capsys, hf_assets):
    assert tiny_hf.main(["checkpoint", "--out", str(tmp_path / "m"), "--arch", "qwen2", "--kv-heads", "1",
                         "--tokenizer", str(hf_assets.tokenizer), "--vocab-size", "512"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert tiny_hf.main(["tokenizer", "--corpus", str(tmp_path / "none.txt"), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bars
    assert "corpus" in err and "does not exist" in err
    assert tiny_hf.main(["checkpoint", "--out", str(tmp_path / "x"), "--tokenizer", str(hf_assets.tokenizer),
                         "--vocab-size", "400"]) == 2
    assert "has 500 tokens but the model's vocabulary has only 400" in capsys.readouterr().err
