"""Each row's KV cache kept across the turns of a multi-turn rollout, so a turn prefills only what was appended.

A multi-turn rollout (``algorithms/critic_free/multiturn.py``) calls ``generate()`` once per turn with the whole
conversation so far as the prompt. Without a ``TurnCache`` every turn prefills that whole conversation again.
With one, ``generate()`` keeps each row's keys and values when the row finishes (``keep``): every token of its
prompt and of its turn but the last sampled one, which was never fed through the model. The next turn takes them
back (``take``) when they are a prefix of the row's new prompt, and prefills only the rest: the last sampled token
and the environment's observation.

The kept entries live on each rank for its own stage's layers and its own tp heads, so they fit any layout as long
as the layout does not change between turns (it does not within one call). Rows are named by their ``seq_id``.

Layout of a micro-batch with kept rows (``generation._MicroBatch``): with ``C`` the longest kept prefix and ``W``
the most new tokens, a row's kept keys fill slots ``[C - c, C)``, its new tokens are left-padded into
``[C, C + W)`` (right-aligned, so every row's last token sits in slot ``C + W - 1``), and generation continues at
``C + W``. Slots between the two are masked out, positions are each row's own token count, so a row attends to
exactly the keys it would after a full prefill.
"""

from __future__ import annotations

import dataclasses

import torch

from realloc.models.llama import KVCache


@dataclasses.dataclass
class KeptRow:
    tokens: torch.Tensor  # [L] long, on the CPU: the tokens whose keys and values are kept
    k: list[torch.Tensor]  # per layer of this stage: [local kv heads, L, head_dim]
    v: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclasses.dataclass
class TurnCache:
    """Kept rows by ``seq_id``, and how many prompt tokens the turns prefilled and took from the cache."""

    rows: dict[int, KeptRow] = dataclasses.field(default_factory=dict)
    prefilled: int = 0  # prompt tokens run through the model
    reused: int = 0  # prompt tokens whose keys and values came from the cache

    def take(self, seq_id: int, row: torch.Tensor) -> KeptRow | None:
        """The kept entry of ``seq_id`` (removed), if its tokens are a proper prefix of ``row``; else None."""
        kept = self.rows.pop(seq_id, None)
        n = row.numel()
        if kept is None or kept.length >= n or not torch.equal(kept.tokens, row[:kept.length].cpu()):
            self.prefilled += n
            return None
        self.prefilled += n - kept.length
        self.reused += kept.length
        return kept

    def keep(self, seq_id: int, tokens: torch.Tensor, caches: list[KVCache], index: int,
             slots: torch.Tensor) -> None:
        """Keep row ``index`` of a micro-batch's ``caches`` at the cache ``slots`` that hold ``tokens``."""
        self.rows[seq_id] = KeptRow(tokens.cpu(), [c.k[index][:, slots].clone() for c in caches],
                                    [c.v[index][:, slots].clone() for c in caches])

    def drop(self, seq_ids: list[int]) -> None:
        """Forget rows that will not generate again (their rollout ended)."""
        for i in seq_ids:
            self.rows.pop(i, None)


def restore(caches: list[KVCache], kept: list[KeptRow | None], end: int) -> None:
    """Write each kept row's keys and values into slots ``[end - length, end)`` of the fresh ``caches``."""
    for b, row in enumerate(kept):
        if row is None:
            continue
        lo = end - row.length
        for c, k, v in zip(caches, row.k, row.v):
            c.k[b, :, lo:end] = k
            c.v[b, :, lo:end] = v
        if caches and caches[0].pos is not None:  # a sliding window: the kept prefix holds positions 0..length-1
            caches[0].pos[b, lo:end] = torch.arange(row.length, device=caches[0].pos.device)
