"""A tokenizer directory read with the ``tokenizers`` library alone, where transformers would load it unchanged.

transformers' generic fast tokenizer (``PreTrainedTokenizerFast``, ``TokenizersBackend`` in tokenizer_config.json)
wraps the ``tokenizers.Tokenizer`` of tokenizer.json, and for the directories :func:`plain_backend` accepts it
changes nothing in it at load: every special token it names is already one of tokenizer.json's special tokens,
the file has its own post-processor (so none is rebuilt), no truncation or padding to switch off, no chat
template, no extra files. Its encoding (``encode_batch_fast``) and decoding (no clean-up of spaces, transformers'
default) are then the backend's own, so this wrapper gives the same ids and texts as transformers while importing
0.03 CPU s instead of transformers' 0.7 (in the master and in every worker at start-up: docs/speed.md).
``tests/test_light_tokenizer.py`` compares both on the shipped tokenizers. Anything else loads with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

# tokenizer_config.json keys whose meaning this wrapper reproduces; any other key (add_bos_token, chat_template,
# added_tokens_decoder, split_special_tokens, ...) may change what transformers builds, so it loads there.
PLAIN_KEYS = frozenset({"backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                        "model_max_length", "clean_up_tokenization_spaces"})
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
# Files transformers would read besides these two (special tokens, added tokens, chat templates, slow vocabularies).
OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
# transformers patches the pre-tokenizer of some large vocabularies (Mistral's regex) at load.
MAX_VOCAB = 100_000


class PlainBackend:
    """The parts of transformers' fast tokenizer that ``data/tokenizer.py`` reads, over a ``tokenizers.Tokenizer``."""

    is_fast = True
    chat_template = None

    def __init__(self, backend: Any, special: dict[str, str | None]) -> None:
        self.backend_tokenizer = backend
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.pad_token = special.get("pad_token")

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def plain_backend(path: Path, generic_classes: frozenset[str]) -> PlainBackend | None:
    """``path``'s tokenizer through ``tokenizers`` alone, or None where transformers might build something else."""
    if any((path / f).exists() for f in OTHER_FILES) or not (path / "tokenizer.json").is_file():
        return None
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        raw = json.loads((path / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (not isinstance(cfg, dict) or not isinstance(raw, dict) or cfg.get("tokenizer_class") not in generic_classes
            or not set(cfg) <= PLAIN_KEYS or cfg.get("clean_up_tokenization_spaces")
            or raw.get("truncation") is not None or raw.get("padding") is not None
            or raw.get("post_processor") is None):
        return None
    special = {k: cfg.get(k) for k in SPECIAL}
    if not all(v is None or isinstance(v, str) for v in special.values()):
        return None  # an AddedToken dict: its flags are transformers' business
    added = {t.get("content"): t for t in raw.get("added_tokens", []) if isinstance(t, dict)}
    if any(v is not None and not added.get(v, {}).get("special") for v in special.values()):
        return None  # transformers would add it as a new special token
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path / "tokenizer.json"))
    except Exception:  # the tokenizers library's own error types: transformers reports them as it does
        return None
    if backend.get_vocab_size() > MAX_VOCAB:
        return None
    return PlainBackend(backend, special)
