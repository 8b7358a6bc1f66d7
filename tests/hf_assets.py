"""Tiny HF assets shared by the test suite: one tokenizer and a few checkpoints, built once per session.

Use the session fixture ``hf_assets`` (tests/conftest.py)::

    def test_x(hf_assets):
        tok_dir = hf_assets.tokenizer                  # trained on experiments/data/tiny_corpus.txt
        path = hf_assets.checkpoint("qwen2_mqa_tied")  # built on first use, then reused
        path = hf_assets.checkpoint("llama", layers=2) # a variant: its own directory, also cached

Every checkpoint has the tokenizer's files, a vocabulary of 512 (the tokenizer has 500 tokens:
padded, as published checkpoints are), 4 layers and 8 attention heads of width 16, so tp=8 and
pp=4 layouts exist. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "experiments" / "data" / "tiny_corpus.txt"
TOKENIZER_VOCAB = 500
MODEL_VOCAB = 512

BASE = dict(vocab_size=MODEL_VOCAB, hidden=128, layers=4, heads=8, intermediate=352)
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", kv_heads=4, max_shard_size="200KB", seed=1),  # sharded safetensors
    "llama_gqa_tied": dict(arch="llama", kv_heads=2, tie=True, seed=2),
    "llama_mqa": dict(arch="llama", kv_heads=1, seed=3),
    "qwen2": dict(arch="qwen2", kv_heads=2, seed=4),
    "qwen2_mqa_tied": dict(arch="qwen2", kv_heads=1, tie=True, seed=5),
    "llama_reward": dict(arch="llama", head="seqcls", kv_heads=2, seed=6),
    "qwen2_reward": dict(arch="qwen2", head="seqcls", kv_heads=2, seed=7),
}


class HFAssets:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._tokenizer: Path | None = None
        self._built: dict[str, Path] = {}

    @property
    def tokenizer(self) -> Path:
        if self._tokenizer is None:
            from realloc.tiny_assets.hf import train_tokenizer

            self._tokenizer = train_tokenizer(CORPUS, self.root / "tokenizer", vocab_size=TOKENIZER_VOCAB)
        return self._tokenizer

    def spec(self, name: str, **overrides: Any) -> dict[str, Any]:
        """The make_tiny_checkpoint arguments of a named checkpoint (with overrides)."""
        if name not in CHECKPOINTS:
            raise KeyError(f"no tiny checkpoint {name!r}; known: {sorted(CHECKPOINTS)}")
        return {**BASE, **CHECKPOINTS[name], **overrides}

    def checkpoint(self, name: str, **overrides: Any) -> Path:
        from realloc.tiny_assets.hf import make_tiny_checkpoint

        key = name + ("" if not overrides else "-" + json.dumps(overrides, sort_keys=True))
        if key not in self._built:
            out = self.root / f"ckpt{len(self._built)}-{name}"
            self._built[key] = make_tiny_checkpoint(out, tokenizer_dir=self.tokenizer, **self.spec(name, **overrides))
        return self._built[key]
