"""Writing a small file atomically, safe beside a peer writing the same file.

A fixed temporary name (``plan.json.tmp``) is shared by two processes saving the same file at once (two
``realloc search --out plan.json``, two ``realloc profile`` runs into one folder): one truncates the other's
half-written file, and the slower one's rename then fails or publishes a torn file. Each writer here has its own
temporary name, so readers see one whole version, the last renamed. Beside it, ``safetensors_os_errors``: a
safetensors file that could not be written fails as the OSError it is; ``naming``: a failed write names its file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from pathlib import Path
from typing import Iterator

from safetensors import SafetensorError


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Re-raise an OSError without a file name as one naming ``path``: a buffered file's failed write, flush or
    close (a full disk) carries no name, and a run ended with just `No space left on device`."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


def write_text_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its previous content, never a mix; the file gets the umask's mode, as
    ``Path.write_text`` gives it. A path that is a device or a pipe (``--out /dev/stdout``) is written in place:
    a rename would replace the device itself."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    try:
        if path.exists() and not path.is_file():
            path.write_text(text)
            return
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:  # a full disk fails the write or the close, whose error names no file: name the target
        if e.filename is None or str(e.filename).endswith(".tmp"):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


@contextlib.contextmanager
def safetensors_os_errors(path: Path) -> Iterator[None]:
    """Writes of safetensors files inside: a failed write (a full disk, a quota) comes out as the ``OSError`` it
    is, naming ``path``. safetensors raises its own ``SafetensorError`` ("Error while serializing: I/O error: No
    space left on device (os error 28)"), which the CLI could only call an internal error."""
    try:
        yield
    except Exception as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if not isinstance(e, SafetensorError) or code is None:
            raise
        n = int(code.group(1))
        raise OSError(n, os.strerror(n), str(path)) from None
