"""Where in the user's own code an error was raised: the experiment file, or a module it imports.

An error raised by a user's reward function, train step or a module their experiment imports passes through
realloc's own frames (the worker, the registry) and often ends in a library (torch, json). The line a user
needs is the innermost one of *their* code: a frame outside realloc's package, the standard library and the
installed packages.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path
from types import TracebackType

_PACKAGE = Path(__file__).resolve().parent


def _library_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(sorted(roots))


def is_user_file(filename: str) -> bool:
    """A file of the user's: not realloc's, not the standard library's or an installed package's."""
    if not filename or filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    if path.is_relative_to(_PACKAGE):
        return False
    return not any(path.is_relative_to(root) for root in _library_roots())


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's own code, or None."""
    frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
    return frames[-1] if frames else None


def where(e: BaseException) -> str:
    """``" (in FILE, line N: CODE)"`` for the innermost user frame of ``e``'s traceback, else ``""``."""
    f = user_frame(e.__traceback__)
    if f is None:
        return ""
    code = f": {f.line.strip()}" if f.line else ""
    return f" (in {f.filename}, line {f.lineno}{code})"
