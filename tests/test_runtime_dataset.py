"""Prompt dataset: validation, and a data position that is a pure function of (seed, iteration)."""

import json

import pytest
import torch

from realloc.runtime.dataset import PromptDataset, write_random_prompts


def test_batches_cover_each_epoch_once_and_are_reproducible(tmp_path):
    path = write_random_prompts(tmp_path / "p.jsonl", 10, 3, 64, seed=0)
    ds = PromptDataset.load(path, prompt_len=3, vocab_size=64)
    assert len(ds) == 10 and ds.prompts.shape == (10, 3)
    rows = torch.cat([ds.batch_rows(t, 4, seed=7) for t in range(5)])  # 20 rows = 2 epochs
    assert sorted(rows[:10].tolist()) == list(range(10)) and sorted(rows[10:].tolist()) == list(range(10))
    assert not torch.equal(rows[:10], rows[10:])  # a fresh permutation per epoch
    assert torch.equal(ds.batch_rows(3, 4, seed=7), rows[12:16])  # resuming at iteration 3 sees the same rows
    assert not torch.equal(ds.batch_rows(0, 4, seed=8), rows[:4])
    assert torch.equal(ds.batch(2, 4, 7, ids=[1, 3]), ds.prompts[rows[[9, 11]]])


@pytest.mark.parametrize("line, match", [
    ('{"prompt": [1, 2]}', "has 2 tokens but the experiment's prompt_len is 3"),
    ('{"prompt": [1, 2, 99]}', "token ids must be in"),
    ('{"text": "hi"}', "expected"),
    ("not json", "not JSON"),
])
def test_bad_lines_name_the_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{match}"):
        PromptDataset.load(path, prompt_len=3, vocab_size=64)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        PromptDataset.load(tmp_path / "nope.jsonl", prompt_len=3)
