"""Prompt datasets: text, chat or token-id prompts of any length up to ``prompt_len``, as token ids.

Formats: JSON lines (``.jsonl``, or ``.json`` holding JSON lines or one array of records) and
Parquet (``.parquet``). A record carries one of:

- ``prompt`` (``DataConfig.prompt_key``): a string, tokenized with the tokenizer (BOS added per
  ``add_special_tokens``; or rendered as one user turn of the chat template when
  ``use_chat_template``), or a list of token ids used as they are;
- ``messages`` (``DataConfig.messages_key``): ``[{"role": ..., "content": ...}, ...]``, rendered
  with the tokenizer's chat template and its generation prompt.

Prompts longer than ``prompt_len`` are truncated or dropped (``DataConfig.overflow``); empty ones
are dropped; :class:`LoadStats` counts both for the run log. A batch is right-padded with the
tokenizer's pad id and carries every prompt's length.

The batch of iteration t is positions ``[t*B, (t+1)*B)`` of an endless stream that visits the
dataset in a fresh seeded permutation every epoch, so the data position is a pure function of
(seed, iteration): a resumed run continues with exactly the prompts an uninterrupted run would
have used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from realloc.data import cache
from realloc.data.config import DataConfig
from realloc.data.tokenizer import Tokenizer

SUFFIXES = (".jsonl", ".json", ".parquet")
_EXPECTED_HINT = ("expected a prompt column (text or token ids) or a messages column (chat turns); name yours "
                  "with DataConfig(prompt_key=..., messages_key=...)")


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"dataset:{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


@dataclasses.dataclass(frozen=True)
class LoadStats:
    source: str
    prompt_len: int
    n_records: int
    n_kept: int
    n_truncated: int  # kept, cut to prompt_len
    n_dropped: int  # not kept: longer than prompt_len with overflow="drop", or empty
    n_empty: int  # of n_dropped: empty prompts
    max_tokens: int  # over kept prompts, after truncation
    mean_tokens: float

    @property
    def n_too_long(self) -> int:
        """Prompts longer than prompt_len (truncated or dropped)."""
        return self.n_truncated + self.n_dropped - self.n_empty

    def describe(self) -> str:
        return (f"prompts {self.source}: {self.n_kept}/{self.n_records} kept, {self.n_truncated} truncated and "
                f"{self.n_dropped - self.n_empty} dropped for exceeding prompt_len={self.prompt_len}, "
                f"{self.n_empty} empty dropped; tokens per prompt max {self.max_tokens}, mean {self.mean_tokens:.1f}")


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
    columns = [k for k in keys if k in schema.names]
    if not columns:
        raise ValueError(f"dataset {path}: has columns {schema.names} but none of {list(keys)}; "
                         f"{_EXPECTED_HINT}")
    rows = pq.read_table(path, columns=columns).to_pylist()
    yield from ((f"{path} row {i}", rec) for i, rec in enumerate(rows))


def _records(path: Path, cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist; set the experiment's `dataset` field to a JSONL or "
                         f"Parquet file of prompts (a path relative to the experiment file)")
    if path.suffix == ".parquet":
        return _read_parquet(path, (cfg.prompt_key, cfg.messages_key))
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path)
    raise ValueError(f"dataset {path}: unsupported extension {path.suffix!r}; use one of {', '.join(SUFFIXES)}")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise ValueError(f"dataset {where}: {key!r} must be a list of {{\"role\": str, \"content\": str}} messages, "
                         f"got {json.dumps(value, default=str)[:80]}")
    return value


# -- records to token ids -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Records:
    """Every record of the file, sorted by kind; texts and chats are tokenized in batches."""

    wheres: list[str] = dataclasses.field(default_factory=list)  # "file:line" / "file row i" per record
    ids: list[list[int] | None] = dataclasses.field(default_factory=list)  # None until tokenized
    empty: list[bool] = dataclasses.field(default_factory=list)
    texts: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (record, text)
    chats: list[tuple[int, list, str]] = dataclasses.field(default_factory=list)  # (record, messages, key)


def _collect(path: Path, cfg: DataConfig) -> _Records:
    out = _Records()
    for where, rec in _records(path, cfg):
        if not isinstance(rec, dict):
            raise ValueError(f"dataset {where}: expected a JSON object with a {cfg.prompt_key!r} or "
                             f"{cfg.messages_key!r} key, got {type(rec).__name__}")
        i = len(out.wheres)
        out.wheres.append(where)
        out.ids.append(None)
        prompt, messages = rec.get(cfg.prompt_key), rec.get(cfg.messages_key)
        if isinstance(prompt, str):
            out.empty.append(not prompt.strip())
            if cfg.use_chat_template:
                out.chats.append((i, [{"role": "user", "content": prompt}], cfg.prompt_key))
            else:
                out.texts.append((i, prompt))
        elif _is_ids(prompt):
            out.empty.append(not prompt)
            out.ids[i] = prompt
        elif prompt is not None:
            raise ValueError(f"dataset {where}: {cfg.prompt_key!r} must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        elif messages is not None:
            out.chats.append((i, _check_messages(messages, where, cfg.messages_key), cfg.messages_key))
            out.empty.append(not messages)
        elif cfg.prompt_key in rec or cfg.messages_key in rec:
            key = cfg.prompt_key if cfg.prompt_key in rec else cfg.messages_key
            raise ValueError(f"dataset {where}: {key!r} is null; give every record a prompt or remove the record")
        else:
            raise ValueError(f"dataset {where}: no {cfg.prompt_key!r} or {cfg.messages_key!r} key (the record has "
                             f"{sorted(rec)}); {_EXPECTED_HINT}")
    if not out.wheres:
        raise ValueError(f"dataset {path} has no prompts; add records with a {cfg.prompt_key!r} or "
                         f"{cfg.messages_key!r} key")
    return out


def _tokenize(recs: _Records, tokenizer: Tokenizer | None, cfg: DataConfig) -> None:
    if (recs.texts or recs.chats) and tokenizer is None:
        i, key = (recs.texts[0][0], cfg.prompt_key) if recs.texts else recs.chats[0][::2]
        raise ValueError(f"dataset {recs.wheres[i]}: {key!r} holds text, which needs a tokenizer; set the "
                         f"experiment's tokenizer to an HF tokenizer directory, or store token ids")
    if recs.chats and not tokenizer.has_chat_template:
        i, _, key = recs.chats[0]
        hint = " or DataConfig(use_chat_template=False)" if key == cfg.prompt_key else ""
        raise ValueError(f"dataset {recs.wheres[i]}: {key!r} needs a chat template, but tokenizer {tokenizer.path} "
                         f"has none; use a chat model's tokenizer, or plain-text prompts{hint}")
    if recs.texts:
        for (i, _), t in zip(recs.texts, tokenizer.encode_batch([t for _, t in recs.texts], cfg.add_special_tokens)):
            recs.ids[i] = t
    if recs.chats:
        for (i, _, _), t in zip(recs.chats, tokenizer.encode_chat_batch([c for _, c, _ in recs.chats])):
            recs.ids[i] = t


def _truncate(ids: list[int], n: int, side: str, bos: int | None) -> list[int]:
    if side == "right":
        return ids[:n]
    if bos is not None and n > 1 and ids[0] == bos:  # keep the BOS the model expects at position 0
        return ids[:1] + ids[len(ids) - n + 1:]
    return ids[len(ids) - n:]


# -- the dataset -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PromptDataset:
    path: str
    prompt_len: int
    pad_token_id: int
    stats: LoadStats
    flat: torch.Tensor  # int32, every kept prompt's ids back to back
    offsets: torch.Tensor  # int64 [len + 1]: prompt i is flat[offsets[i]:offsets[i + 1]]

    @classmethod
    def load(cls, path: str | Path, prompt_len: int, *, tokenizer: Tokenizer | None = None,
             config: DataConfig = DataConfig(), vocab_size: int | None = None,
             cache_dir: str | Path | None = None) -> "PromptDataset":
        """Read, tokenize, truncate or drop. ``vocab_size`` is the model's: token ids must be below it.

        With ``cache_dir`` the result is kept there (see data/cache.py): the first load of a run
        tokenizes, the others (every worker) read the ids back in milliseconds.
        """
        path = Path(path)
        if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 1:
            raise ValueError(f"dataset {path}: prompt_len must be a positive integer, got {prompt_len!r}")
        if tokenizer is not None and vocab_size is not None:
            tokenizer.check_model_vocab(vocab_size, f"dataset {path}")
        if cache_dir is None:
            return cls._build(path, prompt_len, tokenizer, config, vocab_size)
        _records(path, config)  # a missing file or an unknown extension fails here, before any hashing
        file = cache.cache_file(Path(cache_dir), path, prompt_len, tokenizer, config, vocab_size)
        hit = cache.read(file)
        if hit is not None:
            tensors, meta = hit
            return cls(meta["path"], prompt_len, meta["pad_token_id"], LoadStats(**meta["stats"]),
                       tensors["flat"], tensors["offsets"])
        ds = cls._build(path, prompt_len, tokenizer, config, vocab_size)
        cache.write(file, {"flat": ds.flat, "offsets": ds.offsets},
                    {"path": ds.path, "pad_token_id": ds.pad_token_id, "stats": dataclasses.asdict(ds.stats)})
        return ds

    @classmethod
    def _build(cls, path: Path, prompt_len: int, tokenizer: Tokenizer | None, config: DataConfig,
               vocab_size: int | None) -> "PromptDataset":
        recs = _collect(path, config)
        _tokenize(recs, tokenizer, config)

        bos = tokenizer.bos_token_id if tokenizer else None
        kept: list[int] = []  # record of each kept prompt
        n_truncated = n_long_dropped = 0
        for i, t in enumerate(recs.ids):
            if recs.empty[i]:
                continue
            if len(t) > prompt_len:
                if config.overflow == "drop":
                    n_long_dropped += 1
                    continue
                n_truncated += 1
                recs.ids[i] = _truncate(t, prompt_len, config.truncation_side, bos)
            kept.append(i)
        n_empty = sum(recs.empty)
        if not kept:
            raise ValueError(f"dataset {path}: all {len(recs.wheres)} prompts were dropped ({n_long_dropped} longer "
                             f"than prompt_len={prompt_len} tokens, {n_empty} empty); use "
                             f"DataConfig(overflow=\"truncate\") or a larger prompt_len")
        lengths = torch.tensor([len(recs.ids[i]) for i in kept], dtype=torch.int64)
        offsets = torch.zeros(len(kept) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        limit = vocab_size if vocab_size is not None else tokenizer.vocab_size if tokenizer else 2**31
        try:
            flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(recs.ids[i] for i in kept),
                                                dtype=np.int64, count=int(offsets[-1])))
        except OverflowError:  # an id beyond int64, outside any vocabulary
            flat = None
        if flat is None or bool(((flat < 0) | (flat >= limit)).any()):
            i, bad = next((i, x) for i in kept for x in recs.ids[i] if not 0 <= x < limit)
            raise ValueError(f"dataset {recs.wheres[i]}: {config.prompt_key!r} has token id {bad}, outside the "
                             f"model's vocabulary [0, {limit}); the ids were made with another tokenizer")
        stats = LoadStats(source=str(path), prompt_len=prompt_len, n_records=len(recs.wheres), n_kept=len(kept),
                          n_truncated=n_truncated, n_dropped=len(recs.wheres) - len(kept), n_empty=n_empty,
                          max_tokens=int(lengths.max()), mean_tokens=float(lengths.float().mean()))
        pad = tokenizer.pad_token_id if tokenizer else 0
        return cls(str(path), prompt_len, pad, stats, flat.to(torch.int32), offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def prompt_tokens(self, row: int) -> list[int]:
        return self.flat[self.offsets[row]:self.offsets[row + 1]].tolist()

    def batch_rows(self, iteration: int, batch_size: int, seed: int) -> torch.Tensor:
        """Dataset row of every sequence of iteration ``iteration``'s batch, [batch_size]."""
        n = len(self)
        stream = torch.arange(iteration * batch_size, (iteration + 1) * batch_size)
        epochs, pos = stream // n, stream % n
        out = torch.empty(batch_size, dtype=torch.int64)
        for epoch in epochs.unique().tolist():
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(_epoch_seed(seed, epoch)))
            here = epochs == epoch
            out[here] = perm[pos[here]]
        return out

    def batch(self, iteration: int, batch_size: int, seed: int,
              ids: Sequence[int] | range | None = None) -> dict[str, torch.Tensor]:
        """Prompts of the batch's sequences ``ids`` (all when None).

        ``tokens``: int64 [len(ids), prompt_len], right-padded with ``pad_token_id``;
        ``lengths``: int64 [len(ids)], each in 1..prompt_len.
        """
        rows = self.batch_rows(iteration, batch_size, seed)
        if ids is not None:
            rows = rows[torch.as_tensor(list(ids), dtype=torch.int64)]
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts
        pos = torch.arange(self.prompt_len)
        valid = pos[None, :] < lengths[:, None]
        index = torch.where(valid, starts[:, None] + pos[None, :], 0)
        pad = torch.tensor(self.pad_token_id, dtype=torch.int64)
        tokens = torch.where(valid, self.flat[index].to(torch.int64), pad)
        return {"tokens": tokens, "lengths": lengths}


def write_random_prompts(path: str | Path, n: int, prompt_len: int, vocab_size: int, seed: int) -> Path:
    """Write ``n`` uniformly random token-id prompts (used to create a synthetic task's dataset file)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, vocab_size, (n, prompt_len), generator=g).tolist()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    return path
