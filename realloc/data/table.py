"""A dataset file as columns of token ids (prompt, and responses for SFT and preference data) plus the
records' other fields, loaded once per run and cached (data/cache.py).

Each dataset kind says how a record becomes cells (a prompt, then zero, one or two responses); the rest
is shared: batched tokenizing, dropping empty records, truncating or dropping long prompts and responses
(``DataConfig.overflow``; prompts keep their end, responses their beginning), the vocabulary check, the
counts of :class:`LoadStats`, and the seeded epoch order of batches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from realloc.data import cache
from realloc.data.config import DataConfig
from realloc.data.records import (Cell, LoadStats, Ragged, batch_rows, check_positive, extra_fields, field_columns,
                                  is_empty, length_summary, read_records, record_dict, tokenize, truncate)
from realloc.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

# record, "file:line", config -> (cells: the prompt, then the responses; the column each came from)
Parse = Callable[[dict, str, DataConfig], tuple[list[Cell], list[str]]]


@dataclasses.dataclass(frozen=True)
class Table:
    path: str
    pad_token_id: int
    stats: LoadStats
    columns: dict[str, Ragged]  # "prompt" first, then the responses
    fields: dict[str, list]  # other fields of the kept records, one value per row (None where absent)

    def to_torch(self) -> "Table":
        """The same table with its token columns as torch tensors (what the dataset classes read)."""
        return dataclasses.replace(self, columns={c: r.to_torch() for c, r in self.columns.items()})


@dataclasses.dataclass(frozen=True)
class Kind:
    """A dataset kind: its name (cache files, messages), its columns and how a record becomes cells."""

    name: str  # "prompts", "sft", "preference"
    columns: tuple[str, ...]  # "prompt", then the response columns
    parse: Parse
    used_keys: Callable[[DataConfig], Sequence[str]]  # record keys the cells read (not kept as fields)


def load_table(kind: Kind, path: str | Path, prompt_len: int, gen_len: int, tokenizer: Tokenizer | None,
               config: DataConfig, vocab_size: int | None, cache_dir: str | Path | None) -> Table:
    path = Path(path)
    check_positive(prompt_len, "prompt_len", path)
    if len(kind.columns) > 1:
        check_positive(gen_len, "gen_len", path)
    if tokenizer is not None and vocab_size is not None:
        tokenizer.check_model_vocab(vocab_size, f"dataset {path}")
    if cache_dir is None:
        return _build(kind, path, prompt_len, gen_len, tokenizer, config, vocab_size)
    read_records(path, config)  # a missing file or an unknown extension fails here, before any hashing
    file = cache.cache_file(Path(cache_dir), path, prompt_len, tokenizer, config, vocab_size, kind=kind.name,
                            gen_len=gen_len)
    hit = cache.read(file)
    if hit is not None:
        tensors, meta = hit
        return Table(meta["path"], meta["pad_token_id"], LoadStats(**meta["stats"]),
                     {c: Ragged.from_tensors(tensors, c) for c in kind.columns}, meta["fields"])
    table = _build(kind, path, prompt_len, gen_len, tokenizer, config, vocab_size)
    tensors = {k: v for c in kind.columns for k, v in table.columns[c].tensors(c).items()}
    cache.write(file, tensors, {"path": table.path, "pad_token_id": table.pad_token_id,
                                "stats": dataclasses.asdict(table.stats), "fields": table.fields})
    return table


def _build(kind: Kind, path: Path, prompt_len: int, gen_len: int, tokenizer: Tokenizer | None, config: DataConfig,
           vocab_size: int | None) -> Table:
    n_cols = len(kind.columns)
    cells: list[Cell] = []
    wheres: list[str] = []
    keys: list[str] = []
    fields: list[dict[str, Any]] = []
    used = kind.used_keys(config)
    for where, rec in read_records(path, config):
        rec = record_dict(rec, where, config)
        row_cells, row_keys = kind.parse(rec, where, config)
        cells += row_cells
        keys += row_keys
        wheres += [where] * n_cols
        fields.append(extra_fields(rec, used))
    n_records = len(fields)
    if not n_records:
        what = "prompts" if n_cols == 1 else "records"
        raise ValueError(f"dataset {path} has no {what}; add records with a {config.prompt_key!r} or "
                         f"{config.messages_key!r} key")
    ids = tokenize(cells, wheres, keys, tokenizer, config)
    empty = [is_empty(c) for c in cells]

    bos = tokenizer.bos_token_id if tokenizer else None
    kept: list[int] = []
    n_empty = n_prompt_dropped = n_response_dropped = n_truncated = n_response_truncated = 0
    for r in range(n_records):
        row = range(r * n_cols, (r + 1) * n_cols)
        if any(empty[i] for i in row):
            n_empty += 1
            continue
        prompt_long = len(ids[row[0]]) > prompt_len
        responses_long = [len(ids[i]) > gen_len for i in row[1:]]
        if config.overflow == "drop" and (prompt_long or any(responses_long)):
            if prompt_long:
                n_prompt_dropped += 1
            else:
                n_response_dropped += 1
            continue
        if prompt_long:
            n_truncated += 1
            ids[row[0]] = truncate(ids[row[0]], prompt_len, config.truncation_side, bos)
        for i, long in zip(row[1:], responses_long):
            if long:  # a response keeps its beginning: the end (EOS) is what is lost
                n_response_truncated += 1
                ids[i] = ids[i][:gen_len]
        kept.append(r)
    if not kept:
        why = f"{n_prompt_dropped} longer than prompt_len={prompt_len} tokens, "
        if n_cols > 1:
            why += f"{n_response_dropped} with a response longer than gen_len={gen_len}, "
        larger = "a larger prompt_len" + (" or gen_len" if n_cols > 1 else "")
        raise ValueError(f"dataset {path}: all {n_records} {'prompts' if n_cols == 1 else 'records'} were dropped "
                         f"({why}{n_empty} empty); use DataConfig(overflow=\"truncate\") or {larger}")
    limit = vocab_size if vocab_size is not None else tokenizer.vocab_size if tokenizer else 2**31
    columns = {}
    for c, name in enumerate(kind.columns):
        at = [r * n_cols + c for r in kept]
        columns[name] = Ragged.build([ids[i] for i in at], limit, [wheres[i] for i in at], [keys[i] for i in at])
    max_p, mean_p = length_summary(columns[kind.columns[0]].lengths())
    resp = {}
    if n_cols > 1:
        max_r, mean_r = length_summary(np.concatenate([columns[c].lengths() for c in kind.columns[1:]]))
        resp = dict(gen_len=gen_len, n_response_truncated=n_response_truncated,
                    n_response_dropped=n_response_dropped, max_response_tokens=max_r, mean_response_tokens=mean_r)
    stats = LoadStats(source=str(path), prompt_len=prompt_len, n_records=n_records, n_kept=len(kept),
                      n_truncated=n_truncated, n_dropped=n_records - len(kept), n_empty=n_empty, max_tokens=max_p,
                      mean_tokens=mean_p, **resp)
    pad = tokenizer.pad_token_id if tokenizer else 0
    return Table(str(path), pad, stats, columns, field_columns([fields[r] for r in kept]))


class Rows:
    """Row access shared by the dataset kinds: the count, the epoch order and the records' other fields."""

    table: Table

    def __len__(self) -> int:
        return len(self.table.columns["prompt"])

    def batch_rows(self, iteration: int, batch_size: int, seed: int) -> "torch.Tensor":
        """Dataset row of every sequence of iteration ``iteration``'s batch, [batch_size]."""
        return batch_rows(len(self), iteration, batch_size, seed)

    def rows(self, iteration: int, batch_size: int, seed: int,
             ids: Sequence[int] | range | None = None) -> "torch.Tensor":
        """The rows of the batch's sequences ``ids`` (all when None)."""
        import torch

        rows = self.batch_rows(iteration, batch_size, seed)
        return rows if ids is None else rows[torch.as_tensor(list(ids), dtype=torch.int64)]

    def field(self, name: str) -> list:
        """Field ``name`` of every row (a string, number or boolean of the record; None where it has none)."""
        if name not in self.table.fields:
            have = ", ".join(map(repr, self.table.fields)) or "none"
            raise ValueError(f"dataset {self.table.path}: no record has a string or number field {name!r} "
                             f"(fields: {have})")
        return self.table.fields[name]

    def record(self, row: int) -> dict[str, Any]:
        """The string, number and boolean fields of row ``row``'s record, besides its prompt and responses."""
        if not 0 <= row < len(self):
            raise ValueError(f"dataset {self.table.path}: row {row} out of range [0, {len(self)})")
        return {k: col[row] for k, col in self.table.fields.items() if col[row] is not None}

    def tokens(self, column: str, row: int) -> list[int]:
        """Token ids of row ``row`` in ``column`` ("prompt", "response", "chosen", "rejected")."""
        return self.table.columns[column].row(row)

    def prompt_tokens(self, row: int) -> list[int]:
        return self.tokens("prompt", row)
