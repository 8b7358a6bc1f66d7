"""An HF tokenizer directory, loaded offline with transformers, with the few facts the runtime needs.

    tok = Tokenizer.load("/ckpt/llama")      # tokenizer.json / tokenizer_config.json (+ generation_config.json)
    ids = tok.encode("What is 2 + 3?")     # with BOS when the tokenizer adds one
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # chat template + generation prompt
    tok.eos_token_ids                       # every id that ends a response

Generation stops at any of ``eos_token_ids``: the tokenizer's EOS plus the ``eos_token_id`` of a
``generation_config.json`` in the same directory (chat models end a turn with a token of their own,
e.g. ``<|im_end|>``, which only the generation config names).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from realloc.data.light_tokenizer import plain_backend

# Files that make up an HF tokenizer, in the order files() lists them. A checkpoint export copies them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt")
_ESSENTIAL = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
GENERATION_CONFIG = "generation_config.json"

Messages = Sequence[Mapping[str, str]]
# tokenizer_config.json classes that AutoTokenizer maps to transformers' generic fast tokenizer: such a directory
# loads through that class directly, which skips AutoTokenizer's scan of every model family's module (1.2 of
# 1.7 CPU seconds, in the master and in every worker at start-up: docs/speed.md).
GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _from_pretrained(path: Path) -> Any:
    """transformers' tokenizer of ``path``, offline: the generic fast class when the directory names it (and has
    its tokenizer.json), else whatever AutoTokenizer picks."""
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        cls = None
    if cls in GENERIC_FAST and (path / "tokenizer.json").is_file():
        plain = plain_backend(path, GENERIC_FAST)  # the same tokenizer without importing transformers
        if plain is not None:
            return plain
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _generation_eos(path: Path) -> list[int]:
    f = path / GENERATION_CONFIG
    if not f.is_file():
        return []
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"tokenizer {path}: {GENERATION_CONFIG} is not a JSON object; fix or remove it") from None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
        raise ValueError(f"tokenizer {path}: {GENERATION_CONFIG} eos_token_id must be an int or a list of ints, "
                         f"got {eos!r}")
    return eos


class Tokenizer:
    """A loaded HF tokenizer. Build it with :meth:`load`."""

    def __init__(self, hf: Any, path: Path, generation_eos: Sequence[int] = ()) -> None:
        self._hf = hf
        self.path = path
        self.vocab_size: int = len(hf)  # added tokens included: every id it can emit is below this
        eos = ([hf.eos_token_id] if hf.eos_token_id is not None else []) + list(generation_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))  # stable order, no duplicates
        if hf.pad_token_id is not None:
            self.pad_token_id: int = hf.pad_token_id
        else:
            self.pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.bos_token_id: int | None = hf.bos_token_id
        self.has_chat_template: bool = bool(getattr(hf, "chat_template", None))
        for name, ids in (("eos", self.eos_token_ids), ("pad", (self.pad_token_id,))):
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"tokenizer {path}: {name} token id(s) {list(ids)} are outside its vocabulary of "
                                 f"{self.vocab_size}; fix {GENERATION_CONFIG} or tokenizer_config.json")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"tokenizer {str(path)!r} is not a directory; point it at an HF tokenizer or checkpoint "
                             f"directory (tokenizer.json, tokenizer_config.json)")
        if not any((path / f).is_file() for f in _ESSENTIAL):
            raise ValueError(f"tokenizer {str(path)!r} has none of {', '.join(_ESSENTIAL)}; point it at a directory "
                             f"written by an HF tokenizer's save_pretrained")
        try:
            hf = _from_pretrained(path)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for bad directories
            raise ValueError(f"tokenizer {str(path)!r}: transformers cannot load it "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        return cls(hf, path, _generation_eos(path))

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos={list(self.eos_token_ids)}, "
                f"pad={self.pad_token_id}, bos={self.bos_token_id}, chat_template={self.has_chat_template})")

    def bos_missing(self) -> str | None:
        """The BOS token a plain-text encoding leaves out, or None: a tokenizer that defines one but whose
        post-processor does not add it (transformers' ``tokenizer(text)`` leaves it out alike). None also when it
        defines no BOS (Qwen2: its models have none)."""
        if self.bos_token_id is None:
            return None
        ids = self.encode("a")
        return None if ids and ids[0] == self.bos_token_id else str(self._hf.bos_token)

    # -- text -> ids ------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of many texts at once (a fast tokenizer encodes them in parallel)."""
        if not texts:
            return []
        if getattr(self._hf, "is_fast", False):
            # What the HF call does for a fast tokenizer, minus building offsets and a BatchEncoding
            # (a third of the time for 100k prompts).
            backend = self._hf.backend_tokenizer
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(list(texts), add_special_tokens=add_special_tokens)]
        out = self._hf(list(texts), add_special_tokens=add_special_tokens, return_attention_mask=False,
                       return_token_type_ids=False)
        return [list(ids) for ids in out["input_ids"]]

    def encode_chat(self, messages: Messages) -> list[int]:
        return self.encode_chat_batch([messages])[0]

    def encode_chat_batch(self, conversations: Sequence[Messages], tools: Sequence[dict] | None = None
                          ) -> list[list[int]]:
        """Each conversation rendered with the chat template and its generation prompt (and ``tools``, JSON schemas
        as ``apply_chat_template`` takes them, where given), then tokenized.

        The template writes the special tokens it wants (BOS included), so none are added on top:
        the ids equal ``apply_chat_template(..., tools=tools, add_generation_prompt=True, tokenize=True)``.
        """
        if not self.has_chat_template:
            raise ValueError(f"tokenizer {self.path} has no chat template, so chat messages cannot be rendered; "
                             f"use a tokenizer whose tokenizer_config.json has a chat_template, or plain-text prompts")
        if not conversations:
            return []
        texts = self._hf.apply_chat_template([list(m) for m in conversations], add_generation_prompt=True,
                                             tokenize=False, **({"tools": list(tools)} if tools else {}))
        return self.encode_batch(texts, add_special_tokens=False)

    def encode_replies(self, conversations: Sequence[Messages], tools: Sequence[dict] | None = None
                       ) -> list[list[int]]:
        """The last message of each conversation (the assistant's reply) as a model should generate it.

        The reply is what the chat template writes after the conversation's prompt (the earlier turns
        rendered with the generation prompt), tokenized without added special tokens and cut after the
        first end-of-turn token (any of ``eos_token_ids``); EOS is appended when the template ends a turn
        with none.
        """
        if not conversations:
            return []
        if not self.has_chat_template:
            raise ValueError(f"tokenizer {self.path} has no chat template, so a chat reply cannot be rendered")
        convs = [list(m) for m in conversations]
        kw = {"tools": list(tools)} if tools else {}  # the prompt as the prompts are rendered (DataConfig.tools)
        prompts = self._hf.apply_chat_template([c[:-1] for c in convs], add_generation_prompt=True, tokenize=False,
                                               **kw)
        fulls = self._hf.apply_chat_template(convs, add_generation_prompt=False, tokenize=False, **kw)
        tails = []
        for conv, prompt, full in zip(convs, prompts, fulls):
            if conv[-1].get("role") != "assistant":
                raise ValueError(f"the last message must be the assistant's reply, got role {conv[-1].get('role')!r}")
            if not full.startswith(prompt):
                raise ValueError(f"tokenizer {self.path}: its chat template does not render a conversation as its "
                                 f"prompt (with the generation prompt) followed by the reply, so the reply cannot "
                                 f"be cut out; give prompt and response as token ids")
            tails.append(full[len(prompt):])
        ends = set(self.eos_token_ids)
        out = []
        for ids in self.encode_batch(tails, add_special_tokens=False):
            cut = next((i + 1 for i, t in enumerate(ids) if t in ends), None)
            if cut is None and not self.eos_token_ids:
                raise ValueError(f"tokenizer {self.path} has no EOS token to end a reply; give responses as token ids")
            out.append(ids[:cut] if cut is not None else ids + [self.eos_token_ids[0]])
        return out

    # -- ids -> text ------------------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- checkpoint --------------------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        """The tokenizer's files in its directory (to copy next to an exported checkpoint)."""
        return [self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()]

    def check_model_vocab(self, model_vocab_size: int, where: str) -> None:
        """Refuse a model that cannot embed every id this tokenizer emits (a checkpoint/tokenizer mismatch).

        A model vocabulary larger than the tokenizer's is normal: checkpoints pad it to a round size.
        """
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"{where}: tokenizer {self.path} has {self.vocab_size} tokens but the model's "
                             f"vocabulary has only {model_vocab_size}; the tokenizer does not belong to this "
                             f"checkpoint (use the tokenizer saved with the model)")
