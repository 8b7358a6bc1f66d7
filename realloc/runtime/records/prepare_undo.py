"""Undoing a ``realloc run --launcher slurm`` that fails while it writes its run directory (a full disk, a quota).

The command writes the plan, run.json, config/, data.json, the secret and job.sbatch; a failure half way left a
half-prepared directory (a plan and no script, or a run.json naming a session that never ran). ``PreparedDir``
undoes it: a directory this command created is removed whole (``run_claim.remove_created``); in a directory that
existed before, what this command added is removed and the files it rewrote get their earlier bytes back, and
nothing else that was there is touched. The command's own error is still the one line the user reads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from types import TracebackType

from realloc.runtime.records.run_claim import remove_created
from realloc.runtime.records.run_record import CONFIG_DIR, RUN_JSON

# the files a prepare rewrites (``run_cli._prepare_run_dir``, the secret, the job script): small, kept in memory
REWRITTEN = ("plan.json", RUN_JSON, "data.json", "secret", "job.sbatch", f"{CONFIG_DIR}/experiment.json",
             f"{CONFIG_DIR}/environment.json")


def contents(root: Path) -> frozenset[str] | None:
    """Every path under ``root`` relative to it (folders end with "/"), or None when ``root`` does not exist: what
    a failed prepare must keep. Taken before the command claims the directory."""
    if not root.is_dir():
        return None
    out = set()
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        prefix = "" if rel == "." else rel + "/"
        out.update(prefix + d + "/" for d in dirs)
        out.update(prefix + f for f in files)
    return frozenset(out)


class PreparedDir:
    """``with PreparedDir(root, before, created): write...``: on an exception, ``root`` is as it was before (see
    the module docstring); ``before`` is ``contents(root)`` from before the claim, ``created`` the outermost
    folder the claim created (None: it existed)."""

    def __init__(self, root: Path, before: frozenset[str] | None, created: Path | None) -> None:
        self.root, self.before, self.created = root, before, created
        self.saved: dict[str, tuple[bytes, int]] = {}

    def __enter__(self) -> PreparedDir:
        for name in REWRITTEN if self.created is None else ():
            path = self.root / name
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink():
                    self.saved[name] = (path.read_bytes(), path.stat().st_mode & 0o7777)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self.undo()

    def undo(self) -> None:
        """Remove what the command added; give rewritten files their earlier bytes (never raises: the command's
        own error is the one to report)."""
        if self.created is not None:
            remove_created(self.root, self.created)
            return
        before = self.before or frozenset()
        for folder, dirs, files in os.walk(self.root):
            rel = os.path.relpath(folder, self.root)
            prefix = "" if rel == "." else rel + "/"
            for d in list(dirs):
                if prefix + d + "/" not in before:  # a new folder: everything in it is new
                    shutil.rmtree(Path(folder) / d, ignore_errors=True)
                    dirs.remove(d)
            for f in files:
                if prefix + f not in before:
                    with contextlib.suppress(OSError):
                        (Path(folder) / f).unlink()
        for name, (data, mode) in self.saved.items():  # (a removed or truncated file too: the secret's rewrite)
            path = self.root / name
            with contextlib.suppress(OSError):
                if not path.is_file() or path.read_bytes() != data:
                    _restore(path, data, mode)


def _restore(path: Path, data: bytes, mode: int) -> None:
    """``path`` holds ``data`` with ``mode`` again, by a rename: never half of it."""
    tmp = path.with_name(f".{path.name}.restore.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
