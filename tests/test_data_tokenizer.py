"""Tokenizer: ids, chat rendering and special tokens against transformers' own AutoTokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from realloc.data.tokenizer import Tokenizer

TEXTS = ["What is 3 plus 4?", "  Leading spaces, trailing newline\n", "héllo wörld, 日本語 ✓", "Ada\twent\n\nhome."]
CHATS = [
    [{"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Where do fish live?"}],
]


def _copy(src, dst, edit=None, drop=()):
    """A copy of a tokenizer directory with tokenizer_config.json edited and some files removed."""
    shutil.copytree(src, dst)
    if edit:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        edit(cfg)
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name in drop:
        (dst / name).unlink()
    return dst


def test_encode_and_decode_match_transformers(tiny_tok, tiny_ref):
    assert tiny_tok.vocab_size == len(tiny_ref) == 500
    for add in (True, False):
        want = [tiny_ref(t, add_special_tokens=add)["input_ids"] for t in TEXTS]
        assert [tiny_tok.encode(t, add) for t in TEXTS] == want
        assert tiny_tok.encode_batch(TEXTS, add) == [tiny_tok.encode(t, add) for t in TEXTS]
    ids = tiny_tok.encode(TEXTS[0])
    assert ids[0] == tiny_tok.bos_token_id == 1 and tiny_tok.encode(TEXTS[0], add_special_tokens=False) == ids[1:]
    for t in TEXTS:  # byte-level BPE: lossless round trip, BOS skipped
        assert tiny_tok.decode(tiny_tok.encode(t)) == t
        assert tiny_ref.decode(tiny_ref(t)["input_ids"], skip_special_tokens=True) == t
    assert tiny_tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + TEXTS[0]


def test_chat_template_matches_transformers_and_the_template_text(tiny_tok, tiny_ref):
    for msgs in CHATS:
        want = tiny_ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert tiny_tok.encode_chat(msgs) == list(want)
    assert tiny_tok.encode_chat_batch(CHATS) == [tiny_tok.encode_chat(m) for m in CHATS]
    text = tiny_tok.decode(tiny_tok.encode_chat(CHATS[0]), skip_special_tokens=False)
    assert text == "<|bos|><|im_start|>user\nWhat is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n"


def test_special_tokens_and_generation_config_eos(tiny_tok, hf_assets, tmp_path):
    # tokenizer eos <|eos|>=2; generation_config.json adds <|im_end|>=4 (and repeats 2: no duplicate)
    tok = tiny_tok
    assert (tok.eos_token_ids, tok.pad_token_id, tok.bos_token_id, tok.has_chat_template) == ((2, 4), 0, 1, True)
    no_gen = Tokenizer.load(_copy(hf_assets.tokenizer, tmp_path / "a", drop=["generation_config.json"]))
    assert no_gen.eos_token_ids == (2,)
    d = _copy(hf_assets.tokenizer, tmp_path / "b")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert Tokenizer.load(d).eos_token_ids == (2, 3)
    no_pad = Tokenizer.load(_copy(hf_assets.tokenizer, tmp_path / "c", edit=lambda c: c.pop("pad_token")))
    assert no_pad.pad_token_id == 2  # falls back to eos
    bare = _copy(hf_assets.tokenizer, tmp_path / "d", drop=["generation_config.json"],
                 edit=lambda c: [c.pop(k) for k in ("pad_token", "eos_token", "bos_token", "chat_template")])
    bare = Tokenizer.load(bare)
    assert (bare.eos_token_ids, bare.pad_token_id, bare.bos_token_id, bare.has_chat_template) == ((), 0, None, False)
    with pytest.raises(ValueError, match="has no chat template"):
        bare.encode_chat(CHATS[0])


def test_files_are_the_tokenizer_and_copies_load_the_same(tiny_tok, tmp_path):
    assert [f.name for f in tiny_tok.files()] == ["tokenizer.json", "tokenizer_config.json"]
    (tmp_path / "copy").mkdir()
    for f in tiny_tok.files():
        shutil.copy(f, tmp_path / "copy" / f.name)
    copy = Tokenizer.load(tmp_path / "copy")
    assert [copy.encode(t) for t in TEXTS] == [tiny_tok.encode(t) for t in TEXTS]
    assert copy.encode_chat(CHATS[1]) == tiny_tok.encode_chat(CHATS[1])


def test_model_vocab_check(tiny_tok):
    tiny_tok.check_model_vocab(500, "m")
    tiny_tok.check_model_vocab(512, "m")  # padded checkpoint vocabulary: fine
    with pytest.raises(ValueError, match=r"actor: tokenizer .* has 500 tokens but the model's vocabulary has only 499"):
        tiny_tok.check_model_vocab(499, "actor")


def test_bad_directories_are_one_clear_error(hf_assets, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer '.*nope' is not a directory"):
        Tokenizer.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"'.*empty' has none of tokenizer.json, tokenizer_config.json"):
        Tokenizer.load(tmp_path / "empty")
    broken = _copy(hf_assets.tokenizer, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken': transformers cannot load it"):
        Tokenizer.load(broken)
    bad_eos = _copy(hf_assets.tokenizer, tmp_path / "bad_eos")
    (bad_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="eos_token_id must be an int or a list of ints"):
        Tokenizer.load(bad_eos)
    (bad_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 900]}))
    with pytest.raises(ValueError, match=r"eos token id\(s\) \[2, 900\] are outside its vocabulary of 500"):
        Tokenizer.load(bad_eos)


def _llama3_like(path, config_eos, generation_eos=None):
    """A hand-made LLaMA-3-instruct-like checkpoint directory (config only: the ids need no weights)."""
    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "bos_token_id": 128000,
           "eos_token_id": config_eos}
    (path / "config.json").write_text(json.dumps(cfg))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000,
                                                                 "eos_token_id": generation_eos}))
    return path


def test_run_eos_ids_join_the_tokenizer_and_the_generating_checkpoint(tiny_tok, tmp_path):
    from types import SimpleNamespace

    from realloc.api import GENERATE, INFERENCE, HFModel
    from realloc.runtime.records.text_io import SpecialTokens

    def spec(actor, reward=None):
        rpcs = [SimpleNamespace(model_name="actor", interface_type=GENERATE),
                SimpleNamespace(model_name="reward", interface_type=INFERENCE)]
        models = {"actor": HFModel(str(actor))} | ({"reward": HFModel(str(reward))} if reward else {})
        return SimpleNamespace(rpcs=rpcs, models=models)

    # generation_config.json names every end of turn; config.json only one of them
    instruct = _llama3_like(tmp_path / "instruct", 128009, [128001, 128008, 128009])
    ids = SpecialTokens.of(spec(instruct), tiny_tok)
    assert ids.eos_token_ids == (2, 4, 128001, 128008, 128009)  # the tokenizer's first, then the checkpoint's
    assert (ids.pad_token_id, ids.bos_token_id) == (0, 1)  # padding and BOS stay the tokenizer's
    # without generation_config.json: config.json's; a non-generating model's ids are not stop tokens
    plain = _llama3_like(tmp_path / "plain", [7, 2])
    other = _llama3_like(tmp_path / "other", 99, [98])
    assert SpecialTokens.of(spec(plain, reward=other), tiny_tok).eos_token_ids == (2, 4, 7)
    # no tokenizer: the checkpoint's ids alone
    alone = SpecialTokens.of(spec(instruct), None)
    assert (alone.eos_token_ids, alone.bos_token_id) == ((128001, 128008, 128009), 128000)
