"""Datasets with responses: SFT pairs and preference pairs (DPO), as the token layout the model consumes.

SFT records, one per line (JSONL) or row (Parquet)::

    {"prompt": "What is 2+3?", "response": "5"}          # text: BOS + prompt, response + EOS
    {"prompt": [1, 7, 9], "response": [12, 2]}           # token ids, used as they are
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}

A chat's prompt is every message before the last, rendered with the chat template and its generation
prompt; the response is the last (assistant) message as the template ends the turn, i.e. its content and
the end-of-turn token (one of the tokenizer's EOS ids). A text prompt with ``use_chat_template`` or a
``messages`` prompt with a separate ``response`` column is treated the same way.

Preference records::

    {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}      # or token ids; or a messages prompt

Batches (``P = prompt_len``, ``T = gen_len``, both maxima; rows right-padded with the pad id)::

    SFTDataset.batch         tokens [n, P+T] int64 (prompt, response, pad), prompt_lens [n] int64,
                             gen_mask [n, T] bool (the response's tokens, a prefix of each row)
    PreferenceDataset.batch  chosen_tokens, rejected_tokens [n, P+T], prompt_lens [n],
                             chosen_mask, rejected_mask [n, T]

Prompts longer than ``prompt_len`` and responses longer than ``gen_len`` are truncated (a prompt keeps
its end per ``DataConfig.truncation_side``, a response its beginning) or drop their record, per
``DataConfig.overflow``; records with an empty prompt or response are dropped; :class:`LoadStats` counts
all of them. Column names come from ``DataConfig`` (``prompt_key``, ``messages_key``, ``response_key``,
``chosen_key``, ``rejected_key``). Batch order, the cache and the records' other fields work as for
:class:`~realloc.data.prompts.PromptDataset`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence


from realloc.data.config import DataConfig
from realloc.data.records import Cell, Chat, LoadStats, Reply, check_messages, prompt_cell, response_cell
from realloc.data.table import Kind, Rows, Table, load_table
from realloc.data.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch comes with the first batch: the master tokenizes and caches without it
    import torch


def _parse_sft(rec: dict, where: str, cfg: DataConfig) -> tuple[list[Cell], list[str]]:
    if rec.get(cfg.prompt_key) is None and rec.get(cfg.messages_key) is not None and cfg.response_key not in rec:
        key = cfg.messages_key  # a conversation that ends with the response
        messages = check_messages(rec[key], where, key)
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(f"dataset {where}: {key!r} must end with the assistant's message, the response to "
                             f"train on (or give the response in a {cfg.response_key!r} column)")
        return [Chat(messages[:-1]), Reply(messages)], [key, key]
    prompt, key = prompt_cell(rec, where, cfg)
    return [prompt, response_cell(rec, cfg.response_key, prompt, where)], [key, cfg.response_key]


def _parse_preference(rec: dict, where: str, cfg: DataConfig) -> tuple[list[Cell], list[str]]:
    prompt, key = prompt_cell(rec, where, cfg)
    return ([prompt, response_cell(rec, cfg.chosen_key, prompt, where),
             response_cell(rec, cfg.rejected_key, prompt, where)], [key, cfg.chosen_key, cfg.rejected_key])


SFT = Kind("sft", ("prompt", "response"), _parse_sft,
           lambda cfg: (cfg.prompt_key, cfg.messages_key, cfg.response_key))
PREFERENCE = Kind("preference", ("prompt", "chosen", "rejected"), _parse_preference,
                  lambda cfg: (cfg.prompt_key, cfg.messages_key, cfg.chosen_key, cfg.rejected_key))


class _PairRows(Rows):
    kind: Kind

    def __init__(self, table: Table, prompt_len: int, gen_len: int) -> None:
        table = table.to_torch()
        self.table = table
        self.path: str = table.path
        self.prompt_len, self.gen_len = prompt_len, gen_len
        self.pad_token_id: int = table.pad_token_id
        self.stats: LoadStats = table.stats

    @classmethod
    def load(cls, path: str | Path, prompt_len: int, gen_len: int, *, tokenizer: Tokenizer | None = None,
             config: DataConfig = DataConfig(), vocab_size: int | None = None,
             cache_dir: str | Path | None = None):
        """Read, tokenize, truncate or drop. ``vocab_size`` is the model's: token ids must be below it.
        With ``cache_dir`` the token ids are kept there for the next load (data/cache.py)."""
        return cls(load_table(cls.kind, path, prompt_len, gen_len, tokenizer, config, vocab_size, cache_dir),
                   prompt_len, gen_len)

    def _sequences(self, rows: torch.Tensor, response: str) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, P+T] prompt + response + pad, and the [n, T] response mask."""
        import torch

        prompts, responses = self.table.columns["prompt"], self.table.columns[response]
        tokens = torch.full((rows.numel(), self.prompt_len + self.gen_len), self.pad_token_id, dtype=torch.int64)
        prompts.place(rows, tokens, 0)
        responses.place(rows, tokens, prompts.lengths(rows))
        mask = torch.arange(self.gen_len).view(1, -1) < responses.lengths(rows).view(-1, 1)
        return tokens, mask


class SFTDataset(_PairRows):
    """Prompt/response pairs for supervised fine-tuning (loss on the response only)."""

    kind = SFT

    def batch(self, iteration: int, batch_size: int, seed: int,
              ids: Sequence[int] | range | None = None) -> dict[str, torch.Tensor]:
        """The batch's sequences ``ids`` (all when None) in the ``seq`` layout: tokens, prompt_lens, gen_mask."""
        rows = self.rows(iteration, batch_size, seed, ids)
        tokens, mask = self._sequences(rows, "response")
        return {"tokens": tokens, "prompt_lens": self.table.columns["prompt"].lengths(rows), "gen_mask": mask}


class PreferenceDataset(_PairRows):
    """Prompts with a chosen and a rejected response (DPO)."""

    kind = PREFERENCE

    def batch(self, iteration: int, batch_size: int, seed: int,
              ids: Sequence[int] | range | None = None) -> dict[str, torch.Tensor]:
        """The batch's pairs ``ids`` (all when None): chosen_tokens, rejected_tokens, prompt_lens, chosen_mask,
        rejected_mask."""
        rows = self.rows(iteration, batch_size, seed, ids)
        chosen, chosen_mask = self._sequences(rows, "chosen")
        rejected, rejected_mask = self._sequences(rows, "rejected")
        return {"chosen_tokens": chosen, "rejected_tokens": rejected,
                "prompt_lens": self.table.columns["prompt"].lengths(rows), "chosen_mask": chosen_mask,
                "rejected_mask": rejected_mask}
