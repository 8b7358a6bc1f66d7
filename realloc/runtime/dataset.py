"""Prompt datasets: a JSONL file of token-id prompts, read by every model worker that needs them.

Each line is ``{"prompt": [token ids]}``. All prompts have the experiment's ``prompt_len``
tokens (the runtime generates fixed-shape batches). The batch of iteration t is positions
``[t*B, (t+1)*B)`` of an endless stream that visits the file in a fresh seeded permutation
every epoch, so the data position is a pure function of (seed, iteration): a resumed run
continues with exactly the prompts an uninterrupted run would have used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"dataset:{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


@dataclasses.dataclass(frozen=True)
class PromptDataset:
    path: str
    prompts: torch.Tensor  # [N, prompt_len] int64

    @classmethod
    def load(cls, path: str | Path, prompt_len: int, vocab_size: int | None = None) -> "PromptDataset":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"dataset {str(path)!r} does not exist; set the experiment's `dataset` field to a "
                             f"JSONL file of {{\"prompt\": [token ids]}} lines")
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"dataset {path}:{lineno}: not JSON ({e.msg})") from None
                ids = rec.get("prompt") if isinstance(rec, dict) else None
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"dataset {path}:{lineno}: expected {{\"prompt\": [token ids]}}")
                if len(ids) != prompt_len:
                    raise ValueError(f"dataset {path}:{lineno}: prompt has {len(ids)} tokens but the experiment's "
                                     f"prompt_len is {prompt_len}")
                if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
                    raise ValueError(f"dataset {path}:{lineno}: token ids must be in [0, {vocab_size})")
                rows.append(ids)
        if not rows:
            raise ValueError(f"dataset {path} has no prompts")
        return cls(str(path), torch.tensor(rows, dtype=torch.int64))

    def __len__(self) -> int:
        return self.prompts.shape[0]

    def batch_rows(self, iteration: int, batch_size: int, seed: int) -> torch.Tensor:
        """Dataset row of every sequence of iteration ``iteration``'s batch, [batch_size]."""
        n = len(self)
        start = iteration * batch_size
        out = torch.empty(batch_size, dtype=torch.int64)
        perms: dict[int, torch.Tensor] = {}
        for j in range(batch_size):
            epoch, pos = divmod(start + j, n)
            if epoch not in perms:
                perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(_epoch_seed(seed, epoch)))
            out[j] = perms[epoch][pos]
        return out

    def batch(self, iteration: int, batch_size: int, seed: int, ids: list[int] | range | None = None) -> torch.Tensor:
        """Prompts of the batch's sequences ``ids`` (all when None), [len(ids), prompt_len]."""
        rows = self.batch_rows(iteration, batch_size, seed)
        if ids is not None:
            rows = rows[torch.as_tensor(list(ids), dtype=torch.int64)]
        return self.prompts[rows]


def write_random_prompts(path: str | Path, n: int, prompt_len: int, vocab_size: int, seed: int) -> Path:
    """Write ``n`` uniformly random prompts (used to create a synthetic task's dataset file)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, vocab_size, (n, prompt_len), generator=g).tolist()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    return path
