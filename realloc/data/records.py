"""What every dataset kind shares: reading records, turning their columns into token ids, ragged storage of
ids, the extra fields of each record, and the seeded epoch order of batches.

A record's columns become *cells*: token ids given in the file, or text to tokenize (:class:`Text`), a chat to
render with its generation prompt (:class:`Chat`) or an assistant reply to render as the chat template ends
it (:class:`Reply`). The cells of a whole file are tokenized in a few batched calls (:func:`tokenize`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

import numpy as np

from realloc.data.config import DataConfig
from realloc.data.prompt_tools import prompt_tools
from realloc.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

SUFFIXES = (".jsonl", ".json", ".parquet")
EXPECTED_HINT = ("expected a prompt column (text or token ids) or a messages column (chat turns); name yours "
                 "with DataConfig(prompt_key=..., messages_key=...)")
Scalar = Union[str, int, float, bool]


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """What loading a dataset kept and cut. The response fields are for datasets with responses (SFT,
    preference pairs: both responses of a pair count); a record dropped for its prompt is not counted again
    for its responses."""

    source: str
    prompt_len: int
    n_records: int
    n_kept: int
    n_truncated: int  # kept, prompt cut to prompt_len
    n_dropped: int  # not kept: too long with overflow="drop", or empty
    n_empty: int  # of n_dropped: an empty prompt or response
    max_tokens: int  # prompts, over kept records, after truncation
    mean_tokens: float
    gen_len: int = 0  # 0: a prompt dataset (no responses)
    n_response_truncated: int = 0  # kept, a response cut to gen_len
    n_response_dropped: int = 0  # of n_dropped: a response longer than gen_len with overflow="drop"
    max_response_tokens: int = 0
    mean_response_tokens: float = 0.0

    @property
    def n_too_long(self) -> int:
        """Prompts longer than prompt_len (truncated or dropped)."""
        return self.n_truncated + self.n_dropped - self.n_empty - self.n_response_dropped

    @property
    def n_response_too_long(self) -> int:
        """Responses longer than gen_len (truncated or dropped)."""
        return self.n_response_truncated + self.n_response_dropped

    def describe(self) -> str:
        kind = "records" if self.gen_len else "prompts"
        dropped = self.n_dropped - self.n_empty - self.n_response_dropped
        out = (f"{kind} {self.source}: {self.n_kept}/{self.n_records} kept, {self.n_truncated} truncated and "
               f"{dropped} dropped for exceeding prompt_len={self.prompt_len}, ")
        if self.gen_len:
            out += (f"{self.n_response_truncated} responses truncated and {self.n_response_dropped} records dropped "
                    f"for exceeding gen_len={self.gen_len}, ")
        out += f"{self.n_empty} empty dropped; tokens per prompt max {self.max_tokens}, mean {self.mean_tokens:.1f}"
        if self.gen_len:
            out += f", per response max {self.max_response_tokens}, mean {self.mean_response_tokens:.1f}"
        return out


# -- reading records -------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON array of records
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path}: not JSON (line {e.lineno}: {e.msg}); write one JSON object per "
                                 f"line or one array of objects") from None
            yield from ((f"{path} record {i}", rec) for i, rec in enumerate(records))
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path}:{lineno}: not JSON ({e.msg}); write one JSON object per "
                                 f"line") from None


def _read_parquet(path: Path, keys: Sequence[str]) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"dataset {path}: reading Parquet needs pyarrow; pip install pyarrow "
                         f"(or convert the file to JSON lines)") from None
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for files that are not Parquet
        raise ValueError(f"dataset {path}: not a Parquet file ({type(e).__name__}: {e})") from None
    if not any(k in schema.names for k in keys):
        raise ValueError(f"dataset {path}: has columns {schema.names} but none of {list(keys)}; {EXPECTED_HINT}")
    rows = pq.read_table(path).to_pylist()  # every column: the fields besides the prompt are kept too
    yield from ((f"{path} row {i}", rec) for i, rec in enumerate(rows))


def read_records(path: Path, cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    """("file:line" or "file row i", record) of every record; a missing file or a bad extension fails at once."""
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist; set the experiment's `dataset` field to a JSONL or "
                         f"Parquet file of prompts (a path relative to the experiment file)")
    if path.suffix == ".parquet":
        return _read_parquet(path, (cfg.prompt_key, cfg.messages_key))
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise ValueError(f"dataset {path}: unsupported extension {path.suffix!r}; use one of {', '.join(SUFFIXES)}")


# -- cells: one column of one record, before tokenizing --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Text:
    text: str
    special: bool  # the tokenizer's special tokens (BOS) around it
    eos: bool = False  # a response: the tokenizer's first EOS id follows


@dataclasses.dataclass(frozen=True)
class Chat:
    messages: list  # rendered with the chat template and its generation prompt


@dataclasses.dataclass(frozen=True)
class Reply:
    messages: list  # the last message (the assistant's) as the template ends the turn


Cell = Union[list, Text, Chat, Reply]  # a list is token ids, used as they are


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def is_empty(cell: Cell) -> bool:
    if isinstance(cell, Text):
        return not cell.text.strip()
    if isinstance(cell, Chat):  # a chat without any text
        return all(not m["content"].strip() for m in cell.messages)
    if isinstance(cell, Reply):
        return not cell.messages[-1]["content"].strip()
    return not cell


def check_messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise ValueError(f"dataset {where}: {key!r} must be a list of {{\"role\": str, \"content\": str}} messages, "
                         f"got {json.dumps(value, default=str)[:80]}")
    return value


def record_dict(rec: Any, where: str, cfg: DataConfig) -> dict:
    if not isinstance(rec, dict):
        raise ValueError(f"dataset {where}: expected a JSON object with a {cfg.prompt_key!r} or "
                         f"{cfg.messages_key!r} key, got {type(rec).__name__}")
    return rec


def prompt_cell(rec: dict, where: str, cfg: DataConfig) -> tuple[Cell, str]:
    """The prompt of a record and the column it came from: text, token ids or chat messages."""
    prompt, messages = rec.get(cfg.prompt_key), rec.get(cfg.messages_key)
    if isinstance(prompt, str):
        if cfg.use_chat_template:
            return Chat([{"role": "user", "content": prompt}]), cfg.prompt_key
        return Text(prompt, cfg.add_special_tokens), cfg.prompt_key
    if is_ids(prompt):
        return prompt, cfg.prompt_key
    if prompt is not None:
        raise ValueError(f"dataset {where}: {cfg.prompt_key!r} must be a string or a list of token ids, "
                         f"got {type(prompt).__name__}")
    if messages is not None:
        return Chat(check_messages(messages, where, cfg.messages_key)), cfg.messages_key
    if cfg.prompt_key in rec or cfg.messages_key in rec:
        key = cfg.prompt_key if cfg.prompt_key in rec else cfg.messages_key
        raise ValueError(f"dataset {where}: {key!r} is null; give every record a prompt or remove the record")
    raise ValueError(f"dataset {where}: no {cfg.prompt_key!r} or {cfg.messages_key!r} key (the record has "
                     f"{sorted(rec)}); {EXPECTED_HINT}")


def response_cell(rec: dict, key: str, prompt: Cell, where: str) -> Cell:
    """Column ``key`` of a record, a response: token ids as they are; text after a chat prompt becomes the
    assistant's reply (ended as the chat template ends a turn); text after a plain prompt is followed by EOS."""
    value = rec.get(key)
    if is_ids(value):
        return value
    if isinstance(value, str):
        if isinstance(prompt, Chat):
            return Reply(prompt.messages + [{"role": "assistant", "content": value}])
        return Text(value, special=False, eos=True)
    if value is None:
        what = "is null" if key in rec else f"is missing (the record has {sorted(rec)})"
        raise ValueError(f"dataset {where}: {key!r} {what}; every record needs a {key!r}: the response text or its "
                         f"token ids (name the column with DataConfig)")
    raise ValueError(f"dataset {where}: {key!r} must be a string or a list of token ids, got {type(value).__name__}")


def extra_fields(rec: dict, used: Sequence[str]) -> dict[str, Scalar]:
    """The record's string, number and boolean fields besides the columns the dataset reads."""
    return {k: v for k, v in rec.items() if k not in used and isinstance(v, (str, int, float, bool))}


def field_columns(per_row: Sequence[dict[str, Scalar]]) -> dict[str, list]:
    """Row-wise field dicts -> one list per field name (None where a row lacks the field)."""
    names = dict.fromkeys(k for row in per_row for k in row)
    return {k: [row.get(k) for row in per_row] for k in names}


# -- tokenizing -------------------------------------------------------------------------------------------------


def tokenize(cells: list[Cell], where: Sequence[str], keys: Sequence[str],
             tokenizer: Tokenizer | None, cfg: DataConfig) -> list[list[int]]:
    """Token ids of every cell, in batched tokenizer calls; ``where``/``keys`` name each cell in errors."""
    pending = [i for i, c in enumerate(cells) if not isinstance(c, list)]
    if pending and tokenizer is None:
        i = pending[0]
        raise ValueError(f"dataset {where[i]}: {keys[i]!r} holds text, which needs a tokenizer; set the "
                         f"experiment's tokenizer to an HF tokenizer directory, or store token ids")
    chats = [i for i in pending if isinstance(cells[i], (Chat, Reply))]
    if chats and not tokenizer.has_chat_template:
        i = chats[0]
        hint = " or DataConfig(use_chat_template=False)" if keys[i] != cfg.messages_key else ""
        raise ValueError(f"dataset {where[i]}: {keys[i]!r} needs a chat template, but tokenizer {tokenizer.path} "
                         f"has none; use a chat model's tokenizer, or plain-text prompts{hint}")
    out: list[list[int]] = [c if isinstance(c, list) else [] for c in cells]
    for special in (True, False):
        idx = [i for i in pending if isinstance(cells[i], Text) and cells[i].special == special]
        for i, ids in zip(idx, tokenizer.encode_batch([cells[i].text for i in idx], special) if idx else []):
            out[i] = ids
    eos_needed = [i for i in pending if isinstance(cells[i], Text) and cells[i].eos]
    if eos_needed and not tokenizer.eos_token_ids:
        raise ValueError(f"dataset {where[eos_needed[0]]}: {keys[eos_needed[0]]!r} is text, which is ended with the "
                         f"tokenizer's EOS, but tokenizer {tokenizer.path} has none; give the response as token ids")
    for i in eos_needed:
        out[i] = out[i] + [tokenizer.eos_token_ids[0]]
    plain = [where[i] for i in pending if isinstance(cells[i], Text) and keys[i] == cfg.prompt_key]
    first = next((cells[i].messages for i in chats if isinstance(cells[i], Chat)), None)
    tools = prompt_tools(cfg, tokenizer, plain[0] if plain else None, first) if chats or plain else None
    idx = [i for i in pending if isinstance(cells[i], Chat)]
    for i, ids in zip(idx, tokenizer.encode_chat_batch([cells[i].messages for i in idx], tools) if idx else []):
        out[i] = ids
    idx = [i for i in pending if isinstance(cells[i], Reply)]
    try:
        replies = tokenizer.encode_replies([cells[i].messages for i in idx], tools) if idx else []
    except ValueError as e:
        raise ValueError(f"dataset {where[idx[0]]}: {keys[idx[0]]!r}: {e}") from None
    for i, ids in zip(idx, replies):
        out[i] = ids
    return out


def truncate(ids: list[int], n: int, side: str, bos: int | None) -> list[int]:
    if side == "right":
        return ids[:n]
    if bos is not None and n > 1 and ids[0] == bos:  # keep the BOS the model expects at position 0
        return ids[:1] + ids[len(ids) - n + 1:]
    return ids[len(ids) - n:]


# -- ragged token storage ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ragged:
    """Rows of token ids of different lengths: row i is ``flat[offsets[i]:offsets[i + 1]]``.

    Built and cached as numpy arrays, so that the master tokenizes a dataset without importing torch
    (docs/speed.md); the dataset classes the workers read hold the same arrays as torch tensors (``to_torch``)."""

    flat: Any  # int32: a numpy array, or a torch tensor after to_torch
    offsets: Any  # int64 [rows + 1], likewise

    @classmethod
    def build(cls, rows: Sequence[list[int]], limit: int, where: Sequence[str], key: Sequence[str]) -> "Ragged":
        """Pack ``rows``; every id must be in [0, limit) (``where``/``key`` name each row in the error)."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        try:
            flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
        except OverflowError:  # an id beyond int64, outside any vocabulary
            flat = None
        if flat is None or bool(((flat < 0) | (flat >= limit)).any()):
            i, bad = next((i, x) for i, r in enumerate(rows) for x in r if not 0 <= x < limit)
            raise ValueError(f"dataset {where[i]}: {key[i]!r} has token id {bad}, outside the model's vocabulary "
                             f"[0, {limit}); the ids were made with another tokenizer")
        return cls(flat.astype(np.int32), offsets)

    def to_torch(self) -> "Ragged":
        """The same rows over torch tensors (sharing the arrays' memory)."""
        import torch

        return Ragged(*(torch.from_numpy(a if a.flags.writeable else a.copy()) if isinstance(a, np.ndarray) else a
                        for a in (self.flat, self.offsets)))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self, rows: Any = None) -> Any:
        lengths = self.offsets[1:] - self.offsets[:-1]
        return lengths if rows is None else lengths[rows]

    def row(self, i: int) -> list[int]:
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tolist()

    def place(self, rows: "torch.Tensor", out: "torch.Tensor", start: "torch.Tensor | int") -> "torch.Tensor":
        """Write row ``rows[b]`` into ``out[b]`` from column ``start[b]`` (columns past ``out`` are cut off);
        returns the bool mask of the written positions (torch tensors: ``to_torch``)."""
        import torch

        n, width = out.shape
        starts, lengths = self.offsets[rows], self.lengths(rows)
        pos = torch.arange(width).view(1, width) - torch.as_tensor(start).view(-1, 1)
        valid = (pos >= 0) & (pos < lengths.view(-1, 1))
        index = torch.where(valid, starts.view(-1, 1) + pos, 0)
        out.copy_(torch.where(valid, self.flat[index].to(out.dtype), out))
        return valid

    def tensors(self, name: str) -> dict[str, Any]:
        return {f"{name}.flat": self.flat, f"{name}.offsets": self.offsets}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any], name: str) -> "Ragged":
        return cls(tensors[f"{name}.flat"], tensors[f"{name}.offsets"])


def length_summary(lengths: np.ndarray) -> tuple[int, float]:
    # The mean in float32, as torch's ``lengths.float().mean()`` computed it before (data.json's numbers).
    return int(lengths.max()), float(lengths.astype(np.float32).mean())


# -- epoch order ------------------------------------------------------------------------------------------------


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"dataset:{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


def batch_rows(n: int, iteration: int, batch_size: int, seed: int) -> "torch.Tensor":
    """Dataset rows of batch ``iteration``: positions ``[t*B, (t+1)*B)`` of an endless stream that visits the
    ``n`` rows in a fresh seeded permutation every epoch, so rows are a pure function of (seed, iteration)."""
    import torch

    stream = torch.arange(iteration * batch_size, (iteration + 1) * batch_size)
    epochs, pos = stream // n, stream % n
    out = torch.empty(batch_size, dtype=torch.int64)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_epoch_seed(seed, epoch)))
        here = epochs == epoch
        out[here] = perm[pos[here]]
    return out


def check_positive(value: Any, name: str, path: Path) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"dataset {path}: {name} must be a positive integer, got {value!r}")
