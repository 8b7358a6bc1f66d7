"""SFT and preference datasets, and the records' other fields: layouts and counts written out by hand,
text and chat checked against transformers, and every bad input."""

from __future__ import annotations

import json

import pytest
import torch

from realloc.data import DataConfig, PreferenceDataset, PromptDataset, SFTDataset
from realloc.tiny_assets.hf import EOS_ID, IM_END_ID, PAD_ID


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _full_chat_ids(tiny_ref, messages):
    out = tiny_ref.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# -- token ids: layout, truncation and dropping by hand --------------------------------------------------------


def test_sft_token_ids_layout_truncation_and_drop(tmp_path):
    # prompt_len 3, gen_len 2. Record 1: prompt too long (4); record 2: response too long (3); record 3: empty.
    recs = [{"prompt": [5, 6], "response": [7]}, {"prompt": [1, 2, 3, 4], "response": [8, 9]},
            {"prompt": [10], "response": [11, 12, 13]}, {"prompt": [14], "response": []},
            {"prompt": [15, 16, 17], "response": [18, 19]}]
    path = _jsonl(tmp_path / "sft.jsonl", recs)
    ds = SFTDataset.load(path, 3, 2)
    assert [(ds.prompt_tokens(r), ds.tokens("response", r)) for r in range(len(ds))] == [
        ([5, 6], [7]), ([2, 3, 4], [8, 9]), ([10], [11, 12]), ([15, 16, 17], [18, 19])]
    s = ds.stats
    assert (s.n_records, s.n_kept, s.n_truncated, s.n_response_truncated, s.n_dropped, s.n_empty) == (5, 4, 1, 1, 1, 1)
    assert (s.max_tokens, s.mean_tokens, s.max_response_tokens, s.mean_response_tokens) == (3, 9 / 4, 2, 7 / 4)
    rows = ds.batch_rows(0, 4, seed=1)
    b = ds.batch(0, 4, seed=1)
    want = {0: [5, 6, 7, 0, 0], 1: [2, 3, 4, 8, 9], 2: [10, 11, 12, 0, 0], 3: [15, 16, 17, 18, 19]}
    assert b["tokens"].tolist() == [want[r] for r in rows.tolist()]
    assert b["prompt_lens"].tolist() == [{0: 2, 1: 3, 2: 1, 3: 3}[r] for r in rows.tolist()]
    assert b["gen_mask"].tolist() == [[True, r != 0] for r in rows.tolist()]
    assert b["tokens"].dtype == b["prompt_lens"].dtype == torch.int64 and b["gen_mask"].dtype == torch.bool
    drop = SFTDataset.load(path, 3, 2, config=DataConfig(overflow="drop"))
    assert [drop.prompt_tokens(r) for r in range(len(drop))] == [[5, 6], [15, 16, 17]]
    s = drop.stats
    assert (s.n_kept, s.n_dropped, s.n_empty, s.n_too_long, s.n_response_dropped, s.n_response_too_long) == \
        (2, 3, 1, 1, 1, 1)
    assert s.describe() == (f"records {path}: 2/5 kept, 0 truncated and 1 dropped for exceeding prompt_len=3, "
                            f"0 responses truncated and 1 records dropped for exceeding gen_len=2, 1 empty dropped; "
                            f"tokens per prompt max 3, mean 2.5, per response max 2, mean 1.5")


def test_preference_token_ids_layout_and_drop(tmp_path):
    recs = [{"prompt": [5], "chosen": [6, 7], "rejected": [8]},
            {"prompt": [1, 2], "chosen": [3], "rejected": [4, 4, 4]},  # rejected too long for gen_len 2
            {"prompt": [9, 9], "chosen": [], "rejected": [1]}]  # empty chosen
    path = _jsonl(tmp_path / "pref.jsonl", recs)
    ds = PreferenceDataset.load(path, 2, 2)
    b = ds.batch(0, 2, seed=0, ids=[0, 1])
    rows = ds.batch_rows(0, 2, seed=0).tolist()
    want = {0: ([5, 6, 7, 0], [5, 8, 0, 0], 1, [True, True], [True, False]),
            1: ([1, 2, 3, 0], [1, 2, 4, 4], 2, [True, False], [True, True])}
    got = list(zip(b["chosen_tokens"].tolist(), b["rejected_tokens"].tolist(), b["prompt_lens"].tolist(),
                   b["chosen_mask"].tolist(), b["rejected_mask"].tolist()))
    assert got == [want[r] for r in rows]
    assert (ds.stats.n_response_truncated, ds.stats.n_empty, ds.stats.n_kept) == (1, 1, 2)
    assert ds.stats.mean_response_tokens == (2 + 1 + 1 + 2) / 4  # both responses of each kept pair
    drop = PreferenceDataset.load(path, 2, 2, config=DataConfig(overflow="drop"))
    assert len(drop) == 1 and drop.stats.n_response_dropped == 1 and drop.tokens("rejected", 0) == [8]


def test_every_kind_shares_the_seeded_epoch_order(tmp_path):
    n = 7
    prompts = PromptDataset.load(_jsonl(tmp_path / "p.jsonl", [{"prompt": [i + 1]} for i in range(n)]), 2)
    sft = SFTDataset.load(_jsonl(tmp_path / "s.jsonl", [{"prompt": [i + 1], "response": [1]} for i in range(n)]), 2, 2)
    for t in range(4):  # 12 rows: crosses an epoch boundary
        assert torch.equal(sft.batch_rows(t, 3, seed=5), prompts.batch_rows(t, 3, seed=5))
    rows = torch.cat([sft.batch_rows(t, 3, seed=5) for t in range(4)])
    assert sorted(rows[:n].tolist()) == list(range(n))
    assert sft.batch(2, 3, 5)["tokens"][:, 0].tolist() == [r + 1 for r in rows[6:9].tolist()]


# -- text and chat against transformers ------------------------------------------------------------------------


def test_sft_text_and_chat_match_transformers(tmp_path, tiny_tok, tiny_ref):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "It is four."}]
    recs = [{"prompt": "What is 2 plus 2?", "response": "four"}, {"messages": chat},
            {"messages": chat[:2], "response": "It is four."}]
    ds = SFTDataset.load(_jsonl(tmp_path / "sft.jsonl", recs), 64, 16, tokenizer=tiny_tok)
    assert ds.prompt_tokens(0) == tiny_ref("What is 2 plus 2?")["input_ids"]
    assert ds.tokens("response", 0) == tiny_ref("four", add_special_tokens=False)["input_ids"] + [EOS_ID]
    # The whole conversation as transformers renders it is the prompt, the reply up to <|im_end|>, then "\n".
    full = _full_chat_ids(tiny_ref, chat)
    for r in (1, 2):
        prompt, reply = ds.prompt_tokens(r), ds.tokens("response", r)
        assert prompt + reply + tiny_ref("\n", add_special_tokens=False)["input_ids"] == full
        assert reply[-1] == IM_END_ID and tiny_tok.decode(reply) == "It is four."
    templ = SFTDataset.load(tmp_path / "sft.jsonl", 64, 16, tokenizer=tiny_tok,
                            config=DataConfig(use_chat_template=True))
    one_turn = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "four"}]
    assert templ.prompt_tokens(0) + templ.tokens("response", 0) + [full[-1]] == _full_chat_ids(tiny_ref, one_turn)


def test_preference_chat_prompt_and_pad_id(tmp_path, tiny_tok, tiny_ref):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    ds = PreferenceDataset.load(_jsonl(tmp_path / "p.jsonl", [{"messages": msgs, "chosen": "apple",
                                                                "rejected": "stone"}]), 32, 8, tokenizer=tiny_tok)
    prompt = _full_chat_ids(tiny_ref, msgs + [{"role": "assistant", "content": "apple"}])
    b = ds.batch(0, 1, seed=0)
    n = int(b["prompt_lens"][0]) + int(b["chosen_mask"][0].sum())
    assert b["chosen_tokens"][0, :n].tolist() == prompt[:-1]  # all but the template's trailing "\n"
    assert b["chosen_tokens"][0, n:].tolist() == [PAD_ID] * (32 + 8 - n)
    assert tiny_tok.decode(ds.tokens("rejected", 0)) == "stone"


# -- the records' other fields ---------------------------------------------------------------------------------


def test_fields_follow_dataset_rows_and_the_cache(tmp_path):
    recs = [{"prompt": [1], "answer": "7", "id": 0}, {"prompt": [], "answer": "dropped"},
            {"prompt": [2, 3], "answer": "12", "difficulty": 0.5, "ok": True, "tags": ["x"], "meta": {"a": 1}},
            {"prompt": [4], "id": 3}]
    path = _jsonl(tmp_path / "p.jsonl", recs)
    for attempt in range(2):  # the second load reads the cache
        ds = PromptDataset.load(path, 4, cache_dir=tmp_path / "cache")
        assert ds.field("answer") == ["7", "12", None] and ds.field("id") == [0, None, 3]
        assert ds.record(1) == {"answer": "12", "difficulty": 0.5, "ok": True}  # lists and objects are not kept
        assert ds.record(2) == {"id": 3}
    rows = ds.batch_rows(1, 2, seed=3)
    assert [ds.field("answer")[r] for r in rows.tolist()] == [["7", "12", None][r] for r in rows.tolist()]
    with pytest.raises(ValueError, match=r"p.jsonl: no record has a string or number field 'answr' \(fields: "
                                         r"'answer', 'id', 'difficulty', 'ok'\)"):
        ds.field("answr")
    with pytest.raises(ValueError, match=r"row 3 out of range \[0, 3\)"):
        ds.record(3)
    sft = SFTDataset.load(_jsonl(tmp_path / "s.jsonl", [{"prompt": [1], "response": [2], "answer": "3"}]), 2, 2)
    assert sft.record(0) == {"answer": "3"}  # the response column is not a field


def test_parquet_keeps_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": [1, 2], "chosen": [3], "rejected": [4], "answer": "a"}]),
                   tmp_path / "p.parquet")
    ds = PreferenceDataset.load(tmp_path / "p.parquet", 4, 4)
    assert ds.record(0) == {"answer": "a"} and ds.tokens("chosen", 0) == [3]


# -- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, record, kwargs, match", [
    ("sft", {"prompt": [1]}, {}, r"bad.jsonl:2: 'response' is missing \(the record has \['prompt'\]\); every "
                                 r"record needs a 'response'"),
    ("sft", {"prompt": [1], "response": None}, {}, r"bad.jsonl:2: 'response' is null"),
    ("sft", {"prompt": [1], "response": 5}, {}, r"bad.jsonl:2: 'response' must be a string or a list of token ids"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}]}, {},
     r"bad.jsonl:2: 'messages' must end with the assistant's message"),
    ("sft", {"prompt": [1], "response": "text"}, {}, r"bad.jsonl:2: 'response' holds text, which needs a tokenizer"),
    ("sft", {"prompt": [1], "response": [2, 64]}, {"vocab_size": 64},
     r"bad.jsonl:2: 'response' has token id 64, outside the model's vocabulary"),
    ("preference", {"prompt": [1], "chosen": [2]}, {}, r"bad.jsonl:2: 'rejected' is missing"),
    ("preference", {"prompt": [1], "chosen": [2], "wrong": [3]}, {"config": DataConfig(rejected_key="wrong")}, None),
])
def test_bad_records_name_the_file_line_and_key(tmp_path, kind, record, kwargs, match):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": [1], "response": [2], "chosen": [2], "rejected": [3],
                                           "wrong": [3]}, record])
    cls = SFTDataset if kind == "sft" else PreferenceDataset
    if match is None:  # renamed columns are read
        assert len(cls.load(path, 4, 4, **kwargs)) == 2
        return
    with pytest.raises(ValueError, match=match):
        cls.load(path, 4, 4, **kwargs)


def test_file_level_errors(tmp_path):
    long = _jsonl(tmp_path / "long.jsonl", [{"prompt": [1], "response": [2, 2, 2]}, {"prompt": [1] * 5,
                                                                                   "response": [2]}])
    with pytest.raises(ValueError, match=r"long.jsonl: all 2 records were dropped \(1 longer than prompt_len=4 "
                                         r"tokens, 1 with a response longer than gen_len=2, 0 empty\); use "
                                         r"DataConfig\(overflow=\"truncate\"\) or a larger prompt_len or gen_len"):
        SFTDataset.load(long, 4, 2, config=DataConfig(overflow="drop"))
    with pytest.raises(ValueError, match=r"gen_len must be a positive integer, got 0"):
        SFTDataset.load(long, 4, 0)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl has no records"):
        PreferenceDataset.load(tmp_path / "empty.jsonl", 4, 4)
    with pytest.raises(ValueError, match=r"DataConfig.response_key and DataConfig.chosen_key are both 'x'"):
        DataConfig(response_key="x", chosen_key="x")


def test_runtime_loads_each_kind(tmp_path):
    from types import SimpleNamespace

    from realloc.runtime.inputs.datasets import dataset_rows, load_dataset

    spec, config = SimpleNamespace(name="exp", prompt_len=3, gen_len=2), SimpleNamespace(data=DataConfig())
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": [i + 1], "response": [9], "chosen": [8], "rejected": [7]}
                                         for i in range(4)])
    sft, pref = (load_dataset(k, str(path), spec, config, None, None, None) for k in ("seq", "pairs"))
    assert isinstance(sft, SFTDataset) and isinstance(pref, PreferenceDataset)
    out = dataset_rows(sft, 1, 4, 0, 2, 4)
    rows = sft.batch_rows(1, 4, 0)[2:4]
    assert torch.equal(out["rows"], rows) and out["tokens"].tolist() == [[r + 1, 9, 0, 0, 0] for r in rows.tolist()]
    assert set(dataset_rows(pref, 0, 4, 0, 0, 4)) == {"chosen_tokens", "rejected_tokens", "prompt_lens", "chosen_mask",
                                                      "rejected_mask", "rows"}
