"""The tokenizer read with the ``tokenizers`` library alone (data/light_tokenizer.py) against transformers' own
load of the same directory: the same ids, texts, vocabulary and special ids, and transformers wherever a
directory could load differently there."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from realloc.data.light_tokenizer import PlainBackend
from realloc.data.tokenizer import GENERIC_FAST, Tokenizer, _from_pretrained

REPO = Path(__file__).resolve().parents[1]
SHIPPED = [REPO / "experiments" / "data" / d for d in ("arith_tokenizer", "calc_tokenizer", "arith_sft")]


def _plain_bpe(hf_assets, tmp_path: Path) -> Path:
    """The tests' byte-level BPE (normalizer, regex pre-tokenizer, BOS post-processor) without its chat template."""
    out = tmp_path / "bpe"
    shutil.copytree(hf_assets.tokenizer, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in ("chat_template.jinja", "chat_template.json", "special_tokens_map.json"):
        (out / f).unlink(missing_ok=True)
    return out


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    chars = "0123456789+-*/= abcxyz()<|>é\n"
    texts = ["", " ", "1+63=", "12*7=84", "<|bos|>2+2=", "2+2=<|eos|>", "héllo wörld  ", "a<|pad|>b"]
    return texts + ["".join(rng.choice(chars) for _ in range(rng.randint(1, 24))) for _ in range(200)]


def _same(path: Path) -> None:
    mine = Tokenizer.load(path)
    assert isinstance(mine._hf, PlainBackend), f"{path} should load without transformers"
    ref = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    assert mine.vocab_size == len(ref)
    assert (mine._hf.bos_token_id, mine._hf.eos_token_id, mine._hf.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    texts = _texts(len(str(path)))
    for special in (True, False):
        assert mine.encode_batch(texts, special) == [ref.encode(t, add_special_tokens=special) for t in texts]
    rng = random.Random(0)
    seqs = [[rng.randrange(len(ref)) for _ in range(rng.randint(0, 12))] for _ in range(300)]
    for skip in (True, False):
        assert [mine.decode(s, skip) for s in seqs] == [ref.decode(s, skip_special_tokens=skip) for s in seqs]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_tokenizers_match_transformers(path: Path) -> None:
    _same(path)


def test_bpe_without_chat_template_matches_transformers(hf_assets, tmp_path: Path) -> None:
    _same(_plain_bpe(hf_assets, tmp_path))


def test_directories_transformers_could_change_load_there(hf_assets, tmp_path: Path) -> None:
    assert not isinstance(_from_pretrained(Path(hf_assets.tokenizer)), PlainBackend)  # a chat template
    base = _plain_bpe(hf_assets, tmp_path)
    cases = {
        "add_bos_token": lambda cfg, raw: cfg.update(add_bos_token=True),  # rebuilds the post-processor
        "unknown special": lambda cfg, raw: cfg.update(eos_token="<|new|>"),  # added as a new token
        "no post-processor": lambda cfg, raw: raw.update(post_processor=None),
        "truncation": lambda cfg, raw: raw.update(truncation={"max_length": 4, "strategy": "LongestFirst",
                                                              "stride": 0, "direction": "Right"}),
        "other class": lambda cfg, raw: cfg.update(tokenizer_class="LlamaTokenizer"),
    }
    for name, change in cases.items():
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(base, d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        raw = json.loads((d / "tokenizer.json").read_text())
        change(cfg, raw)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "tokenizer.json").write_text(json.dumps(raw))
        assert not isinstance(_from_pretrained(d), PlainBackend), name
    assert isinstance(_from_pretrained(base), PlainBackend)
    assert GENERIC_FAST >= {"PreTrainedTokenizerFast"}
