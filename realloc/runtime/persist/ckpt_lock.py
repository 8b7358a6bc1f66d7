"""A committed checkpoint read by ``realloc export`` while the run that owns its directory goes on.

A run deletes its older checkpoints after each save (``checkpoint.prune``) and, at its start, moves the checkpoints
of the history it replaces into ``replaced-*`` (``checkpoint.set_aside_later``). A ``realloc export`` of one of them
running at that moment found its later shards gone and failed with "shard ... is missing", as if the checkpoint
were damaged. So a reader holds a shared ``flock`` on the checkpoint's ``meta.json`` for as long as it reads
(``reading``), and the owner takes it exclusively before it deletes or moves one (``claimed``): prune skips a
checkpoint being read (the next save prunes it), and setting aside waits for the reader. The lock is on the
file's inode, so it holds whatever the directory is renamed to; the kernel drops it however the reader ends. A
filesystem without ``flock`` runs unguarded, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def reading(meta: Path) -> Iterator[None]:
    """Hold a shared lock on a checkpoint's ``meta`` file while the checkpoint is read. Raises ``ValueError`` when
    the checkpoint was moved or deleted before the lock was taken (its owner set it aside or pruned it)."""
    try:
        fd = os.open(meta, os.O_RDONLY)
    except OSError:
        yield  # no meta.json: the reader's own checks say what is wrong
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while the owner moves or deletes this checkpoint
        except OSError:
            pass  # a filesystem without locks
        try:
            same = os.stat(meta).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if not same:
            raise ValueError(f"checkpoint {meta.parent} was moved or deleted while it was being opened (the run in "
                             f"its run directory pruned it or set it aside as replaced history); look for it under "
                             f"the run's checkpoints/replaced-*/ or export another checkpoint")
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def claimed(meta: Path, wait: bool) -> Iterator[bool]:
    """Take a checkpoint's ``meta`` file exclusively, so no reader is inside it while it is deleted or moved.
    Yields False when ``wait`` is False and a reader holds it (the caller leaves the checkpoint alone), else True
    (also when the file is missing or the filesystem has no locks)."""
    try:  # for writing where it may: NFS emulates flock with POSIX locks, whose exclusive kind needs it
        fd = os.open(meta, os.O_RDWR if os.access(meta, os.W_OK) else os.O_RDONLY)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:
            pass  # a filesystem without locks
        yield True
    finally:
        os.close(fd)


def being_read(meta: Path) -> bool:
    """Whether a reader holds ``meta`` now (the owner then waits for it)."""
    with claimed(meta, wait=False) as free:
        return not free
