"""Prompt datasets: formats, truncation and dropping counted by hand, batches, resume, and every bad input."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hf_assets import REPO
from realloc.data import DataConfig, PromptDataset, Tokenizer
from realloc.data.prompts import write_random_prompts

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"}]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rows(ds):
    return [ds.prompt_tokens(i) for i in range(len(ds))]


def _chat_ids(tiny_ref, messages):
    out = tiny_ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# -- token ids (no tokenizer) ----------------------------------------------------------------------------------


def test_token_ids_truncate_and_drop_counts(tmp_path):
    # lengths 3, 5, 8, 0 (empty), 6 at prompt_len 5: two too long, one empty
    recs = [[1, 2, 3], [4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17], [], [20, 21, 22, 23, 24, 25]]
    path = _jsonl(tmp_path / "ids.jsonl", [{"prompt": r} for r in recs])
    left = PromptDataset.load(path, 5)
    assert _rows(left) == [[1, 2, 3], [4, 5, 6, 7, 8], [13, 14, 15, 16, 17], [21, 22, 23, 24, 25]]
    s = left.stats
    assert (s.n_records, s.n_kept, s.n_truncated, s.n_dropped, s.n_empty, s.max_tokens) == (5, 4, 2, 1, 1, 5)
    assert s.mean_tokens == pytest.approx((3 + 5 + 5 + 5) / 4) and s.n_too_long == 2
    right = PromptDataset.load(path, 5, config=DataConfig(truncation_side="right"))
    assert _rows(right)[2:] == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    drop = PromptDataset.load(path, 5, config=DataConfig(overflow="drop"))
    assert _rows(drop) == [[1, 2, 3], [4, 5, 6, 7, 8]]
    s = drop.stats
    assert (s.n_kept, s.n_truncated, s.n_dropped, s.n_empty, s.n_too_long) == (2, 0, 3, 1, 2)
    assert s.describe() == (f"prompts {path}: 2/5 kept, 0 truncated and 2 dropped for exceeding prompt_len=5, "
                            f"1 empty dropped; tokens per prompt max 5, mean 4.0")


def test_batch_layout_padding_and_lengths(tmp_path):
    recs = [[7] * n for n in (1, 4, 2, 3)]
    ds = PromptDataset.load(_jsonl(tmp_path / "p.jsonl", [{"prompt": r} for r in recs]), 4)
    assert ds.pad_token_id == 0  # no tokenizer
    b = ds.batch(0, 4, seed=3)
    rows = ds.batch_rows(0, 4, seed=3)
    assert b["tokens"].dtype == b["lengths"].dtype == torch.int64 and b["tokens"].shape == (4, 4)
    assert b["lengths"].tolist() == [len(recs[r]) for r in rows.tolist()]
    for j, n in enumerate(b["lengths"].tolist()):
        assert b["tokens"][j].tolist() == [7] * n + [0] * (4 - n)
    part = ds.batch(0, 4, seed=3, ids=range(1, 3))
    assert torch.equal(part["tokens"], b["tokens"][1:3]) and torch.equal(part["lengths"], b["lengths"][1:3])


def test_batches_cover_each_epoch_once_and_resume_exactly(tmp_path):
    path = write_random_prompts(tmp_path / "p.jsonl", 10, 3, 64, seed=0)
    ds = PromptDataset.load(path, prompt_len=3, vocab_size=64)
    assert len(ds) == 10
    rows = torch.cat([ds.batch_rows(t, 4, seed=7) for t in range(5)])  # 20 rows = 2 epochs
    assert sorted(rows[:10].tolist()) == list(range(10)) and sorted(rows[10:].tolist()) == list(range(10))
    assert not torch.equal(rows[:10], rows[10:])  # a fresh permutation per epoch
    assert not torch.equal(ds.batch_rows(0, 4, seed=8), rows[:4])
    # A resumed run (a fresh process: a new dataset object) asks for iteration 3 first and sees the same rows.
    again = PromptDataset.load(path, prompt_len=3, vocab_size=64)
    assert torch.equal(again.batch_rows(3, 4, seed=7), rows[12:16])
    want = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    assert again.batch(2, 4, 7, ids=[1, 3])["tokens"].tolist() == [want[r] for r in rows[[9, 11]].tolist()]


# -- text, chat, Parquet ---------------------------------------------------------------------------------------


def test_text_prompts_tokenized_like_transformers_with_truncation(tmp_path, tiny_tok, tiny_ref):
    texts = ["What is 2 plus 2?", "Ada walked to the market to buy bread. Ben was already there. Where did Ada go?",
             "Hi", "   "]
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": t, "answer": "x"} for t in texts])
    full = [tiny_ref(t)["input_ids"] for t in texts[:3]]
    n = 12
    assert len(full[0]) < n < len(full[1])
    ds = PromptDataset.load(path, n, tokenizer=tiny_tok, vocab_size=512)
    assert _rows(ds) == [full[0], full[1][:1] + full[1][-(n - 1):], full[2]]  # left truncation keeps the BOS
    assert (ds.stats.n_truncated, ds.stats.n_empty, ds.pad_token_id) == (1, 1, 0)
    right = PromptDataset.load(path, n, tokenizer=tiny_tok, config=DataConfig(truncation_side="right"))
    assert _rows(right)[1] == full[1][:n]
    no_bos = PromptDataset.load(path, n, tokenizer=tiny_tok, config=DataConfig(add_special_tokens=False))
    assert _rows(no_bos)[:2] == [tiny_ref(t, add_special_tokens=False)["input_ids"][-n:] for t in texts[:2]]


def test_chat_messages_and_chat_template_for_plain_prompts(tmp_path, tiny_tok, tiny_ref):
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:]}, {"prompt": "Hi there"}])
    ds = PromptDataset.load(path, 64, tokenizer=tiny_tok)
    assert _rows(ds) == [_chat_ids(tiny_ref, CHAT), _chat_ids(tiny_ref, CHAT[1:]), tiny_ref("Hi there")["input_ids"]]
    templ = PromptDataset.load(path, 64, tokenizer=tiny_tok, config=DataConfig(use_chat_template=True))
    assert _rows(templ)[2] == _chat_ids(tiny_ref, [{"role": "user", "content": "Hi there"}])
    short = PromptDataset.load(path, 8, tokenizer=tiny_tok)  # left truncation keeps "<|im_start|>assistant\n"
    assert _rows(short)[0] == [1] + _chat_ids(tiny_ref, CHAT)[-7:]
    assert tiny_tok.decode(_rows(short)[0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_shipped_prompt_files_load(tiny_tok):
    data = REPO / "experiments" / "data"
    text = PromptDataset.load(data / "text_prompts.jsonl", 48, tokenizer=tiny_tok, vocab_size=512)
    chat = PromptDataset.load(data / "chat_prompts.jsonl", 48, tokenizer=tiny_tok, vocab_size=512)
    for ds in (text, chat):  # mixed lengths: some short, some truncated
        assert ds.stats.n_kept == ds.stats.n_records == 48 and 0 < ds.stats.n_truncated < 48
        assert min(len(p) for p in _rows(ds)) < 24


def test_parquet_and_json_array_equal_jsonl(tmp_path, tiny_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    recs = [{"prompt": " ".join(rng.choice(["apple", "pear", "red", "go"]) for _ in range(rng.randint(1, 30)))}
            for _ in range(20)]
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}]} for r in recs]
    ids = [{"prompt": [rng.randrange(500) for _ in range(rng.randint(1, 30))]} for _ in range(20)]
    for name, rows in (("text", recs), ("chat", chats), ("ids", ids)):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
        want = PromptDataset.load(_jsonl(tmp_path / f"{name}.jsonl", rows), 16, tokenizer=tiny_tok)
        for suffix in ("parquet", "json"):
            got = PromptDataset.load(tmp_path / f"{name}.{suffix}", 16, tokenizer=tiny_tok)
            assert _rows(got) == _rows(want) and got.stats.n_truncated == want.stats.n_truncated > 0


def test_loading_100_prompts_per_kind_batches_the_tokenizer(tmp_path, tiny_tok, monkeypatch):
    calls = []
    encode = tiny_tok.encode_batch

    def counting(texts, add_special_tokens=True):
        calls.append(len(texts))
        return encode(texts, add_special_tokens)

    monkeypatch.setattr(tiny_tok, "encode_batch", counting)
    recs = [{"prompt": f"question {i}"} for i in range(100)] + [{"messages": CHAT} for _ in range(100)]
    PromptDataset.load(_jsonl(tmp_path / "m.jsonl", recs), 32, tokenizer=tiny_tok)
    assert sorted(calls) == [100, 100]


def test_cache_dir_skips_tokenizing_and_follows_every_input(tmp_path, tiny_tok, monkeypatch):
    path = _jsonl(tmp_path / "m.jsonl", [{"prompt": "What is 2 plus 2?"}, {"messages": CHAT}, {"prompt": ""}])
    cache = tmp_path / "cache"
    first = PromptDataset.load(path, 12, tokenizer=tiny_tok, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized although cached")

    monkeypatch.setattr(tiny_tok, "encode_batch", no_tokenizing)
    again = PromptDataset.load(path, 12, tokenizer=tiny_tok, cache_dir=cache)
    assert _rows(again) == _rows(first) and again.stats == first.stats and again.pad_token_id == first.pad_token_id
    assert torch.equal(again.batch(3, 5, seed=1)["tokens"], first.batch(3, 5, seed=1)["tokens"])
    monkeypatch.undo()
    PromptDataset.load(path, 10, tokenizer=tiny_tok, cache_dir=cache)
    PromptDataset.load(path, 12, tokenizer=tiny_tok, cache_dir=cache, config=DataConfig(truncation_side="right"))
    _jsonl(path, [{"prompt": "What is 2 plus 3?"}])
    changed = PromptDataset.load(path, 12, tokenizer=tiny_tok, cache_dir=cache)
    assert len(changed) == 1 and len(list(cache.glob("*.safetensors"))) == 4 and not list(cache.glob("*.tmp"))


# -- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lines, kwargs, match", [
    (["not json"], {}, r"bad.jsonl:2: not JSON"),
    (['{"text": "hi", "id": 3}'], {}, r"bad.jsonl:2: no 'prompt' or 'messages' key \(the record has \['id', "
                                     r"'text'\]\); expected a prompt column"),
    (['{"prompt": 3}'], {}, r"bad.jsonl:2: 'prompt' must be a string or a list of token ids"),
    (['{"prompt": null}'], {}, r"bad.jsonl:2: 'prompt' is null"),
    (['[1, 2]'], {}, r"bad.jsonl:2: expected a JSON object"),
    (['{"messages": [{"role": "user"}]}'], {"tok": True}, r"bad.jsonl:2: 'messages' must be a list of"),
    (['{"prompt": "hello"}'], {}, r"bad.jsonl:2: 'prompt' holds text, which needs a tokenizer"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], {}, r"bad.jsonl:2: 'messages' holds text, which needs"),
    (['{"prompt": [1, 2, 64]}'], {"vocab_size": 64}, r"bad.jsonl:2: 'prompt' has token id 64, outside the model's "
                                                     r"vocabulary \[0, 64\)"),
    (['{"prompt": [1, -2]}'], {}, r"bad.jsonl:2: 'prompt' has token id -2"),
    (['{"prompt": [1, 99999999999999999999999]}'], {}, r"bad.jsonl:2: 'prompt' has token id 9999"),
    (['{"prompt": "hi"}'], {"tok": True, "vocab_size": 256}, r"dataset .*bad.jsonl: tokenizer .* has 500 tokens "
                                                              r"but the model's vocabulary has only 256"),
])
def test_bad_records_name_the_file_line_and_key(tmp_path, tiny_tok, lines, kwargs, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n" + "\n".join(lines) + "\n")
    tokenizer = tiny_tok if kwargs.pop("tok", False) else None
    with pytest.raises(ValueError, match=match):
        PromptDataset.load(path, 8, tokenizer=tokenizer, **kwargs)


def test_messages_without_chat_template(tmp_path, hf_assets):
    cfg = json.loads((hf_assets.tokenizer / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (tmp_path / "tok").mkdir()
    for f in Tokenizer.load(hf_assets.tokenizer).files():
        (tmp_path / "tok" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = Tokenizer.load(tmp_path / "tok")
    path = _jsonl(tmp_path / "c.jsonl", [{"prompt": "fine"}, {"messages": CHAT}])
    with pytest.raises(ValueError, match=r"c.jsonl:2: 'messages' needs a chat template, but tokenizer .* has none"):
        PromptDataset.load(path, 8, tokenizer=plain)
    with pytest.raises(ValueError, match=r"c.jsonl:1: 'prompt' needs a chat template.*use_chat_template=False"):
        PromptDataset.load(path, 8, tokenizer=plain, config=DataConfig(use_chat_template=True))


def test_file_level_errors(tmp_path, tiny_tok):
    with pytest.raises(ValueError, match=r"dataset '.*nope.jsonl' does not exist"):
        PromptDataset.load(tmp_path / "nope.jsonl", 8)
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"p.csv: unsupported extension '.csv'; use one of .jsonl, .json, .parquet"):
        PromptDataset.load(tmp_path / "p.csv", 8)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty.jsonl has no prompts"):
        PromptDataset.load(tmp_path / "empty.jsonl", 8)
    long = _jsonl(tmp_path / "long.jsonl", [{"prompt": [1] * 9}, {"prompt": [1] * 12}, {"prompt": []}])
    with pytest.raises(ValueError, match=r"long.jsonl: all 3 prompts were dropped \(2 longer than prompt_len=8 "
                                         r"tokens, 1 empty\); use DataConfig\(overflow=\"truncate\"\) or a larger"):
        PromptDataset.load(long, 8, config=DataConfig(overflow="drop"))
    (tmp_path / "arr.json").write_text('[{"prompt": [1]},')
    with pytest.raises(ValueError, match=r"arr.json: not JSON"):
        PromptDataset.load(tmp_path / "arr.json", 8)
    with pytest.raises(ValueError, match="prompt_len must be a positive integer"):
        PromptDataset.load(long, 0)


def test_parquet_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "a", "label": 1}]), tmp_path / "cols.parquet")
    with pytest.raises(ValueError, match=r"cols.parquet: has columns \['text', 'label'\] but none of \['prompt', "
                                         r"'messages'\]; expected a prompt column"):
        PromptDataset.load(tmp_path / "cols.parquet", 8)
    pq.write_table(pa.Table.from_pylist([{"prompt": [1, 2]}, {"prompt": [3, 70]}]), tmp_path / "ids.parquet")
    with pytest.raises(ValueError, match=r"ids.parquet row 1: 'prompt' has token id 70"):
        PromptDataset.load(tmp_path / "ids.parquet", 8, vocab_size=64)
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"fake.parquet: not a Parquet file"):
        PromptDataset.load(tmp_path / "fake.parquet", 8)


@pytest.mark.parametrize("kwargs, match", [
    ({"overflow": "cut"}, r"DataConfig.overflow must be one of 'truncate', 'drop', got 'cut'"),
    ({"truncation_side": "middle"}, r"DataConfig.truncation_side must be one of 'left', 'right'"),
    ({"prompt_key": ""}, r"DataConfig.prompt_key must be a non-empty column name"),
    ({"messages_key": "prompt"}, r"DataConfig.prompt_key and DataConfig.messages_key are both 'prompt'"),
    ({"use_chat_template": "yes"}, r"DataConfig.use_chat_template must be True or False"),
])
def test_data_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)
