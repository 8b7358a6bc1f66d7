"""The dataset a run reads, by the kind of data its calls take from it, and the rows of one call.

The kind comes from the interface slots that read the dataset key (``DataflowGraph.dataset_kind``):
``prompts`` for RL (``realloc.data.PromptDataset``), ``seq`` for SFT (prompt/response pairs,
``SFTDataset``), ``pairs`` for DPO (prompt/chosen/rejected, ``PreferenceDataset``). Every loader keeps
the same seeded order: iteration t's batch is a pure function of (seed, t), so a resumed run reads what
an uninterrupted one would.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from realloc.api import ExperimentSpec

if TYPE_CHECKING:
    import torch


def dataset_table(kind: str, path: str | None, spec: ExperimentSpec, config: Any, tokenizer: Any,
                  vocab_size: int | None, cache_dir: Path | None) -> Any:
    """The dataset's token columns and counts (a ``realloc.data.table.Table``), read, tokenized and cached as
    the workers will load them, without torch: what the master checks and caches before the workers need it."""
    if path is None:
        raise ValueError(f"experiment {spec.name!r} reads a dataset but names none; set `dataset`")
    from realloc.data.table import load_table

    if kind == "prompts":
        from realloc.data.prompts import PROMPTS as table_kind
    elif kind in ("seq", "pairs"):
        from realloc.data.pairs import PREFERENCE, SFT

        table_kind = SFT if kind == "seq" else PREFERENCE
    else:
        raise ValueError(f"experiment {spec.name!r}: no dataset loader supplies {kind!r} data (the kinds are prompts, "
                         f"seq for SFT and pairs for DPO)")
    gen_len = 0 if kind == "prompts" else spec.gen_len
    return load_table(table_kind, path, spec.prompt_len, gen_len, tokenizer, config.data, vocab_size, cache_dir)


def load_dataset(kind: str, path: str | None, spec: ExperimentSpec, config: Any, tokenizer: Any,
                 vocab_size: int | None, cache_dir: Path | None) -> Any:
    table = dataset_table(kind, path, spec, config, tokenizer, vocab_size, cache_dir)
    if kind == "prompts":
        from realloc.data.prompts import PromptDataset

        return PromptDataset(table, spec.prompt_len)
    from realloc.data.pairs import PreferenceDataset, SFTDataset

    return (SFTDataset if kind == "seq" else PreferenceDataset)(table, spec.prompt_len, spec.gen_len)


def dataset_rows(ds: Any, position: int, batch_size: int, seed: int, lo: int, hi: int,
                 group: int = 1) -> dict[str, torch.Tensor]:
    """Sequences [lo, hi) of batch ``position``: with ``group`` responses per prompt, sequence i answers prompt
    i // group, so each prompt is repeated ``group`` times. ``rows`` names each sequence's dataset row."""
    assert lo % group == 0 and hi % group == 0, "a dp rank holds whole groups"
    prompts = range(lo // group, hi // group)
    out = dict(ds.batch(position, batch_size, seed, prompts))
    out["rows"] = ds.batch_rows(position, batch_size, seed)[lo // group:hi // group]
    if group > 1:
        out = {k: v.repeat_interleave(group, dim=0) for k, v in out.items()}
    return out


def dataset_rows_at(ds: Any, position: int, batch_size: int, seed: int, ids: Sequence[int], group: int = 1
                    ) -> dict[str, torch.Tensor]:
    """``dataset_rows`` of the ascending sequence indices ``ids`` (a dp rank's row list: token-balanced ranks,
    a streamed call's part), read run by run of whole groups and cut to the rows asked for."""
    import torch

    runs: list[list[int]] = []  # runs [lo, hi) of consecutive indices
    for i in (int(x) for x in ids):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    runs = runs or [[0, 0]]
    parts = []
    for lo, hi in runs:
        glo, ghi = lo - lo % group, -(-hi // group) * group
        got = dataset_rows(ds, position, batch_size, seed, glo, ghi, group)
        parts.append({k: v[lo - glo:hi - glo] for k, v in got.items()})
    return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
