"""The tiny HF assets of the shipped HF experiments, built once on first use (a few seconds, nothing downloaded).

    paths = demo_assets("experiments/data/hf_tiny")
    paths["tokenizer"], paths["sft"], paths["reward"]

A BPE tokenizer trained on ``experiments/data/tiny_corpus.txt``, a random 4-layer LLaMA causal LM
standing in for an SFT model and a random 2-layer LLaMA sequence classifier standing in for a reward
model, both carrying the tokenizer's files like a published checkpoint. Each directory is built in a
temporary sibling and renamed into place, so concurrent first uses (a master and its workers
importing the experiment) never see a half-written directory.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[2] / "experiments" / "data" / "tiny_corpus.txt"
TOKENIZER_VOCAB = 500
SHAPE = dict(vocab_size=512, hidden=128, heads=8, kv_heads=2, intermediate=352)
MODELS: dict[str, dict[str, Any]] = {
    "sft": dict(arch="llama", head="causal", layers=4, seed=11, **SHAPE),
    "reward": dict(arch="llama", head="seqcls", layers=2, seed=12, **SHAPE),
}


def build_once(target: Path, build: Any) -> Path:
    """``build(tmp)`` into a temporary sibling of ``target``, then renamed into place (once: an existing
    directory is kept; a concurrent builder that loses the race keeps the winner's identical copy)."""
    if target.is_dir():
        return target
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: its copy is identical
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def demo_assets(root: str | Path, corpus: str | Path = CORPUS) -> dict[str, Path]:
    from transformers.utils import logging as hf_logging

    from realloc.tiny_assets.hf import make_tiny_checkpoint, train_tokenizer

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar, once per checkpoint
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok = build_once(root / "tokenizer", lambda d: train_tokenizer(corpus, d, vocab_size=TOKENIZER_VOCAB))
    out = {"tokenizer": tok}
    for name, kw in MODELS.items():
        out[name] = build_once(root / name, lambda d, kw=kw: make_tiny_checkpoint(d, tokenizer_dir=tok, **kw))
    return out
