"""Claiming a run directory for one ``realloc run``.

Two runs writing one directory corrupt each other silently: the second overwrites the first's secret (its
workers are then refused by the first master), truncates its metrics and samples, and writes checkpoints under
the same names. So a run holds an exclusive ``flock`` on ``run.lock`` in its directory for as long as it runs
(released by the kernel however the process ends, SIGKILL included), and a second run on the same directory is
one error naming the holder's pid. A default-named directory (``runs/<experiment>-<time>``: two peers starting
the same experiment in the same second) is never shared: the second takes ``-2``, then ``-3``, ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from realloc.runtime.records.run_paths import os_error_line

LOCK_NAME = "run.lock"
# A job's master (--launcher external) waits this long for the lock: NFS frees a dead client's locks when its
# lease expires (90 s by default).
LOCK_WAIT_S = 180.0
MAX_SUFFIX = 1000  # default names tried before giving up (a directory of that many same-second runs is a bug)


class RunDirInUse(ValueError):
    """Another live ``realloc run`` holds the run directory."""


def check_run_dir(root: Path, create: bool) -> None:
    """The run directory can be created (or is one): one error naming the path if, say, a file is in the way."""
    if create:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"run directory {root}: cannot create it ({e.strerror}: {e.filename}); pass --run-dir "
                             f"a folder you can write to") from None
        if not os.access(root, os.W_OK | os.X_OK):  # (root may write anywhere: then the writes themselves say so)
            raise ValueError(f"run directory {root} is not writable; pass --run-dir a folder you can write to")
        return
    ancestor = next(p for p in (root, *root.parents) if p.exists())
    if not ancestor.is_dir():
        raise ValueError(f"run directory {root}: {ancestor} is a file; pass --run-dir a folder you can write to")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"run directory {root}: {ancestor} is not writable; pass --run-dir a folder you can write to")


def first_missing(root: Path) -> Path | None:
    """The outermost folder of ``root`` (itself or an ancestor) that does not exist yet: what this command
    creates, and removes again when it fails before launching anything."""
    missing = None
    for p in (root, *root.parents):
        if p.exists():
            return missing
        missing = p
    return missing


def lock_run_dir(root: Path, wait_s: float = 0.0) -> int:
    """Take ``root``'s run lock; returns the open descriptor that holds it (close it to release). Raises
    ``RunDirInUse`` naming the holder when another process still has it after ``wait_s`` seconds."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec: no worker inherits the lock
    except OSError as e:
        raise ValueError(f"run directory {root}: cannot write its lock ({os_error_line(e)}); pass --run-dir a "
                         f"folder you can write to") from None
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirInUse(f"run directory {root} is in use by another `realloc run` (pid {holder}); wait for it to "
                          f"end, or pass --run-dir another folder") from None
    except OSError:  # a filesystem without locks (Lustre mounted without flock, some FUSE): run unguarded
        return fd
    with contextlib.suppress(OSError):  # the pid is for the message only: a full disk must not stop the run
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def claim_run_dir(root: Path, create: bool, default_name: bool,
                  wait_s: float = 0.0) -> tuple[Path, Path | None, int | None]:
    """The run directory this command uses: (its path, the outermost folder this command created or None, the
    lock's descriptor or None). ``create`` False (a dry run) only checks. With ``default_name`` the directory is
    realloc's own choice: one that already exists, or that a peer creates first, is skipped for the next suffix.
    ``wait_s``: how long a held lock is waited for (a requeued SLURM job's master: the lock of the job's previous
    master, on a node that died, lasts until the shared filesystem's lease on it expires)."""
    if not create:
        check_run_dir(root, create=False)
        return root, None, None
    if not default_name:
        created = first_missing(root)
        check_run_dir(root, create=True)
        try:
            return root, created, lock_run_dir(root, wait_s)
        except ValueError:
            if created is not None:  # empty folders only: a peer that created it too holds its lock file there
                remove_empty_folders(root, created)
            raise
    outer = first_missing(root.parent)
    check_run_dir(root.parent, create=True)
    for i in range(1, MAX_SUFFIX + 1):
        path = root if i == 1 else root.with_name(f"{root.name}-{i}")
        created = outer or path
        try:
            path.mkdir(parents=True, exist_ok=False)  # atomic: of two peers, exactly one creates it
        except FileExistsError:
            continue
        except OSError as e:
            raise ValueError(f"run directory {path}: cannot create it ({os_error_line(e)}); pass --run-dir a "
                             f"folder you can write to") from None
        return path, created, lock_run_dir(path)
    raise ValueError(f"run directory {root}: {MAX_SUFFIX} runs of this name exist; pass --run-dir")


def remove_created(root: Path, created: Path) -> None:
    """Undo a claim that failed before launching: remove ``root`` (this command's own, locked) and then each
    folder up to ``created`` that is empty. Never a whole ancestor: a peer may have created a run inside it."""
    shutil.rmtree(root, ignore_errors=True)
    if root != created:
        remove_empty_folders(root.parent, created)


def remove_empty_folders(folder: Path, created: Path) -> None:
    """Remove ``folder`` and its ancestors up to ``created`` while they are empty."""
    for p in (folder, *folder.parents):
        if not p.is_relative_to(created):
            break
        try:
            p.rmdir()
        except OSError:
            break  # not empty (a peer's run), or gone


def clear_run_dir(root: Path) -> None:
    """Delete ``root`` to reuse its name (the demos' fixed run directories), unless a live run holds it: then one
    ``RunDirInUse`` error, and nothing of the peer's is touched."""
    if (root / LOCK_NAME).is_file():
        os.close(lock_run_dir(root))  # free: nobody runs there (a peer starting meanwhile creates a new lock file)
    shutil.rmtree(root, ignore_errors=True)
