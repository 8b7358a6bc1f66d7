"""Token batches as the engine accepts them, and their normalized form.

A batch is a mapping of tensors with ``input_ids`` plus one way to tell tokens
from padding:

- ``lengths`` [B]: right-padded rows, row b holds ``lengths[b]`` tokens;
- ``attention_mask`` [B, T]: 1 for tokens, 0 for padding (any side);
- ``cu_seqlens`` [n+1]: packed sequences in one row (``input_ids`` [1, total] or [total]),
  sequence i spans ``cu_seqlens[i]:cu_seqlens[i+1]``.

All three become :class:`TokenLayout`: ids, positions and segment ids (-1 = padding),
which the model turns into rotary positions and an attention mask. Extra keys
(advantages, masks, ...) travel along untouched for the caller's loss function.

Per-token outputs (log-probs, values) come back shaped like ``input_ids`` with
zeros at padding. Log-probs are aligned with the token they score:
``logprobs[b, t] = log p(input_ids[b, t] | tokens before t)``; the first token of
every sequence has no prediction and gets 0.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from realloc.strategy import even_ranges

Batch = Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    input_ids: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor  # [B, T] long, 0 at padding
    segment_ids: torch.Tensor  # [B, T] long, -1 at padding

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def causal_suffices(self) -> bool:
        """One sequence per row, right-padded: plain causal attention is exact for every real token."""
        valid = self.segment_ids >= 0
        return bool((self.segment_ids <= 0).all()) and bool((valid[:, 1:] <= valid[:, :-1]).all())

    def attention_mask(self) -> torch.Tensor | None:
        """None (causal attention) when that suffices, else the explicit segment mask."""
        from realloc.models.llama import segment_mask

        return None if self.causal_suffices else segment_mask(self.segment_ids)

    def next_token_valid(self) -> torch.Tensor:
        """[B, T-1]: token t+1 continues the sequence of token t (so logits at t score it)."""
        s = self.segment_ids
        return (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)

    def to(self, device: torch.device) -> "TokenLayout":
        return TokenLayout(self.input_ids.to(device), self.position_ids.to(device), self.segment_ids.to(device))


def token_layout(batch: Batch, where: str = "batch", max_positions: int | None = None) -> TokenLayout:
    """Normalize a batch; raises ValueError naming the missing or malformed key, or a sequence longer than
    ``max_positions`` (the model's ``max_position_embeddings``: RoPE and the checkpoint are defined up to it)."""
    layout = _token_layout(batch, where)
    if max_positions is not None:
        valid = layout.segment_ids >= 0
        longest = int(layout.position_ids[valid].max()) + 1 if bool(valid.any()) else 0
        if longest > max_positions:
            raise ValueError(f"{where}: a sequence of {longest} tokens exceeds the model's max_position_embeddings="
                             f"{max_positions}; shorten the rows (prompt_len + gen_len) or use a model with a "
                             f"longer context")
    return layout


def _token_layout(batch: Batch, where: str) -> TokenLayout:
    if "input_ids" not in batch:
        raise ValueError(f"{where}: missing key 'input_ids' (token ids, [batch, seq] long)")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: 'input_ids' must be an integer tensor, got {ids.dtype}")
    ids = ids.long()
    given = [k for k in ("lengths", "attention_mask", "cu_seqlens") if k in batch]
    if len(given) != 1:
        raise ValueError(f"{where}: give exactly one of 'lengths', 'attention_mask', 'cu_seqlens' "
                         f"(got {given or 'none'})")
    key = given[0]
    if key == "cu_seqlens":
        cu = torch.as_tensor(batch["cu_seqlens"]).long().to(ids.device)
        flat = ids.reshape(1, -1)
        total = flat.shape[1]
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{where}: 'cu_seqlens' must rise from 0 to the {total} packed tokens, got {cu.tolist()}")
        lens = cu[1:] - cu[:-1]
        seg = torch.repeat_interleave(torch.arange(lens.numel(), device=ids.device), lens)
        starts = torch.repeat_interleave(cu[:-1], lens)
        pos = torch.arange(total, device=ids.device) - starts
        return TokenLayout(flat, pos.view(1, -1), seg.view(1, -1))
    if ids.dim() != 2:
        raise ValueError(f"{where}: 'input_ids' must be [batch, seq] with {key!r}, got shape {tuple(ids.shape)}")
    b, t = ids.shape
    if key == "lengths":
        lens = torch.as_tensor(batch["lengths"]).long().to(ids.device)
        if lens.shape != (b,) or bool((lens < 0).any()) or bool((lens > t).any()):
            raise ValueError(f"{where}: 'lengths' must be [batch] with 0 <= length <= {t}, got {lens.tolist()}")
        mask = torch.arange(t, device=ids.device).view(1, t) < lens.view(b, 1)
    else:
        mask = torch.as_tensor(batch["attention_mask"]).to(ids.device)
        if mask.shape != (b, t):
            raise ValueError(f"{where}: 'attention_mask' must have the shape of input_ids {(b, t)}, "
                             f"got {tuple(mask.shape)}")
        mask = mask.bool()
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0) * mask
    seg = torch.where(mask, torch.zeros_like(ids), torch.full_like(ids, -1))
    return TokenLayout(ids, pos, seg)


def trim(layout: TokenLayout) -> tuple[TokenLayout, int]:
    """Drop trailing all-padding columns (right padding wider than needed); returns the kept width too."""
    valid = (layout.segment_ids >= 0).any(dim=0)
    nz = torch.nonzero(valid)
    width = int(nz[-1]) + 1 if nz.numel() else 1
    if width == layout.shape[1]:
        return layout, width
    return TokenLayout(layout.input_ids[:, :width], layout.position_ids[:, :width],
                       layout.segment_ids[:, :width]), width


def split_rows(layout: TokenLayout, n_mbs: int) -> list[tuple[int, int]]:
    """Row ranges of ``n_mbs`` near-equal micro-batches (a packed single row cannot be split)."""
    b = layout.shape[0]
    if n_mbs < 1 or n_mbs > b:
        raise ValueError(f"n_mbs={n_mbs} must be between 1 and the batch size {b} "
                         f"(a packed batch is one row: use n_mbs=1 or pass padded rows)")
    return list(even_ranges(b, n_mbs))


def split_batch(batch: Batch, n_mbs: int) -> list[dict[str, torch.Tensor]]:
    """Split a padded batch into ``n_mbs`` micro-batches by rows.

    Every tensor whose first dimension is the batch size is split; other values are shared.
    """
    ids = torch.as_tensor(batch["input_ids"]) if "input_ids" in batch else None
    if ids is None or ids.dim() != 2:
        raise ValueError("split_batch: needs a padded batch with 'input_ids' of shape [batch, seq]")
    b = ids.shape[0]
    if "cu_seqlens" in batch:
        raise ValueError("split_batch: cannot split a packed batch ('cu_seqlens'); pack each micro-batch instead")
    ranges = split_rows(TokenLayout(ids, ids, ids), n_mbs)
    out = []
    for lo, hi in ranges:
        mb = {}
        for k, v in batch.items():
            mb[k] = v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v
        out.append(mb)
    return out
