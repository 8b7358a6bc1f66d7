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

A record's other string, number and boolean fields (e.g. a reference ``answer``) are kept per dataset
row: ``field("answer")[row]`` or ``record(row)``, where ``batch_rows`` gives the rows of a batch.

The batch of iteration t is positions ``[t*B, (t+1)*B)`` of an endless stream that visits the
dataset in a fresh seeded permutation every epoch, so the data position is a pure function of
(seed, iteration): a resumed run continues with exactly the prompts an uninterrupted run would
have used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence


from realloc.data.config import DataConfig
from realloc.data.records import SUFFIXES, Cell, LoadStats, Ragged, prompt_cell
from realloc.data.table import Kind, Rows, Table, load_table
from realloc.data.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch comes with the first batch: the master tokenizes and caches without it
    import torch

__all__ = ["SUFFIXES", "LoadStats", "PromptDataset", "write_random_prompts"]

def _parse(rec: dict, where: str, cfg: DataConfig) -> tuple[list[Cell], list[str]]:
    cell, key = prompt_cell(rec, where, cfg)
    return [cell], [key]


PROMPTS = Kind("prompts", ("prompt",), _parse, lambda cfg: (cfg.prompt_key, cfg.messages_key))


class PromptDataset(Rows):
    """The kept prompts of a file as token ids, row by row, with each record's other fields."""

    def __init__(self, table: Table, prompt_len: int) -> None:
        table = table.to_torch()
        self.table = table
        self.path: str = table.path
        self.prompt_len = prompt_len
        self.pad_token_id: int = table.pad_token_id
        self.stats: LoadStats = table.stats
        prompts: Ragged = table.columns["prompt"]
        self.flat: torch.Tensor = prompts.flat  # int32, every kept prompt's ids back to back
        self.offsets: torch.Tensor = prompts.offsets  # int64 [len + 1]: prompt i is flat[offsets[i]:offsets[i + 1]]

    @classmethod
    def load(cls, path: str | Path, prompt_len: int, *, tokenizer: Tokenizer | None = None,
             config: DataConfig = DataConfig(), vocab_size: int | None = None,
             cache_dir: str | Path | None = None) -> "PromptDataset":
        """Read, tokenize, truncate or drop. ``vocab_size`` is the model's: token ids must be below it.

        With ``cache_dir`` the result is kept there (see data/cache.py): the first load of a run
        tokenizes, the others (every worker) read the ids back in milliseconds.
        """
        return cls(load_table(PROMPTS, path, prompt_len, 0, tokenizer, config, vocab_size, cache_dir),
                   prompt_len)

    def batch(self, iteration: int, batch_size: int, seed: int,
              ids: Sequence[int] | range | None = None) -> dict[str, torch.Tensor]:
        """Prompts of the batch's sequences ``ids`` (all when None).

        ``tokens``: int64 [len(ids), prompt_len], right-padded with ``pad_token_id``;
        ``lengths``: int64 [len(ids)], each in 1..prompt_len.
        """
        import torch

        rows = self.rows(iteration, batch_size, seed, ids)
        prompts = self.table.columns["prompt"]
        tokens = torch.full((rows.numel(), self.prompt_len), self.pad_token_id, dtype=torch.int64)
        prompts.place(rows, tokens, 0)
        return {"tokens": tokens, "lengths": prompts.lengths(rows)}


def write_random_prompts(path: str | Path, n: int, prompt_len: int, vocab_size: int, seed: int) -> Path:
    """Write ``n`` uniformly random token-id prompts (used to create a synthetic task's dataset file)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, vocab_size, (n, prompt_len), generator=g).tolist()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    return path
