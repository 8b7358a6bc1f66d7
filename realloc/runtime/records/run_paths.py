"""The files of one run directory: where ``realloc run`` and its workers write, and ``realloc trace``,
``realloc export`` and ``--resume`` read."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import IO

from realloc.atomic_file import naming


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


class NamedFile:
    """A text file written as the run goes (trace.json, requests.jsonl) whose OSErrors name it (``naming``)."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        with naming(path):
            self._f: IO[str] = open(path, mode)

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, text: str) -> None:
        with naming(self.path):
            self._f.write(text)

    def flush(self) -> None:
        with naming(self.path):
            self._f.flush()

    def close(self) -> None:
        with naming(self.path):
            self._f.close()


def os_error_line(e: OSError) -> str:
    """An OSError as the user needs it: the path and the cause (``/runs/a/metrics.jsonl: No space left on
    device``), without Python's ``[Errno 28]``."""
    cause = e.strerror or str(e) or type(e).__name__
    if e.filename and e.filename2:  # a copy (shutil names the source first): the target is as likely the cause
        return f"copying {e.filename} to {e.filename2}: {cause}"
    return f"{e.filename}: {cause}" if e.filename else cause


def remove_secret(path: Path) -> str | None:
    """Remove a run's secret file; never raises. Where its folder forbids removing it (made read-only), the
    file is emptied instead, so no secret stays behind either way. Returns a line for the user when the file
    could not be removed, else None."""
    try:
        path.unlink(missing_ok=True)
        return None
    except OSError as e:
        try:
            os.truncate(path, 0)  # frees its blocks: works on a full disk, and in a read-only folder
            return f"could not remove the run secret {path} ({e.strerror}); it was emptied instead"
        except OSError:
            return f"could not remove the run secret {path} ({e.strerror}); delete it by hand"
