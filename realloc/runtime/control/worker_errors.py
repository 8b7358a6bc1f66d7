"""The one line a failed request's reply carries, which the master prints after ``worker N:``.

An OSError of the machine (a full disk while a checkpoint shard is written, a read-only run directory) reads as
the master's own records' errors do (``run_paths.os_error_line``: ``<path>: No space left on device``), not as
Python's ``OSError: [Errno 28] No space left on device: '<path>'``; any other error as ``Type: message``. Both
end with where in the user's code it was raised, if it was.
"""

from __future__ import annotations

from realloc import user_code
from realloc.runtime.records.run_paths import os_error_line


def reply_error(e: BaseException) -> str:
    """``e`` as one line for the master (an OSError without an errno, raised by hand, keeps its type's name)."""
    text = os_error_line(e) if isinstance(e, OSError) and e.errno is not None else f"{type(e).__name__}: {e}"
    return text + user_code.where(e)
