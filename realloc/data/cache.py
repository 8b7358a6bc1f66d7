"""A tokenized dataset (prompts, SFT or preference records) on disk, so that every worker of a run does not tokenize the file again.

The file name is a digest of everything the token ids depend on: the dataset kind, the dataset file's
bytes, the tokenizer's files, the DataConfig, prompt_len and gen_len, the model vocabulary and the
library versions. A
changed input is a different file; nothing is ever invalidated in place. Files are safetensors
(no pickle), written to a temporary name and renamed, so concurrent loaders never read half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from realloc.atomic_file import safetensors_os_errors
from realloc.data.config import DataConfig
from realloc.data.tokenizer import GENERATION_CONFIG, Tokenizer

FORMAT = 2  # bump when the token layout or the loading rules change


def _hash_file(h: "hashlib._Hash", path: Path) -> None:
    h.update(f"{path.name}\0".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def cache_file(cache_dir: Path, path: Path, prompt_len: int, tokenizer: Tokenizer | None, config: DataConfig,
               vocab_size: int | None, kind: str = "prompts", gen_len: int = 0) -> Path:
    h = hashlib.sha256()
    settings = dataclasses.asdict(config)
    if not config.tools:  # a run without tools keeps the cache files it had before DataConfig.tools existed
        del settings["tools"]
    h.update(json.dumps({"format": FORMAT, "kind": kind, "path": str(path.resolve()), "prompt_len": prompt_len,
                         "gen_len": gen_len, "vocab_size": vocab_size, "config": settings},
                        sort_keys=True).encode())
    _hash_file(h, path)
    if tokenizer is not None:
        # The versions from the packages' metadata: the same strings as their __version__, without importing
        # transformers where the tokenizer does not need it (data/light_tokenizer.py).
        h.update(f"{version('transformers')} {version('tokenizers')}".encode())
        gen = tokenizer.path / GENERATION_CONFIG
        for f in tokenizer.files() + ([gen] if gen.is_file() else []):
            _hash_file(h, f)
    return cache_dir / f"{kind}-{h.hexdigest()[:32]}.safetensors"


# numpy arrays, not torch tensors: the master writes the cache without importing torch (docs/speed.md); the same
# file's bytes as torch's save_file wrote (the arrays' dtypes and shapes are the header's).
def read(file: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    if not file.is_file():
        return None
    with safe_open(str(file), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["meta"])


def write(file: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name, suffix=".tmp")
    os.close(fd)
    try:
        with safetensors_os_errors(file):
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp,
                      metadata={"meta": json.dumps(meta)})
        os.replace(tmp, file)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
