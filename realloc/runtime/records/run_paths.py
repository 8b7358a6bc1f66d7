"""The files of one run directory: where ``realloc run`` and its workers write, and ``realloc trace``,
``realloc export`` and ``--resume`` read."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Files of one run directory."""

    root: Path

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def secret(self) -> Path:
        return self.root / "secret"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def prompt_cache(self) -> Path:
        """Tokenized prompts (realloc/data/cache.py): written by `realloc run` before launch, read by the workers."""
        return self.root / "prompt_cache"

    @property
    def data(self) -> Path:
        """What loading the dataset kept, truncated and dropped (``realloc.data.records.LoadStats``)."""
        return self.root / "data.json"

    @property
    def trace(self) -> Path:
        return self.root / "trace.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def worker_log(self, rank: int) -> Path:
        return self.logs / f"worker{rank}.log"
