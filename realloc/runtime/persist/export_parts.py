"""The hidden temporary folders of HF exports (``export.py``), and removing those a killed export left.

An export writes into ``.NAME.part-HOST-PID-HEX`` beside its ``--out`` and renames it at the end; an export killed
while writing (SIGKILL, the OOM killer, or a master killed during an ``--export-every`` export) leaves that folder,
as large as the model. A folder is this host's and stale when its HOST is this machine and its PID is gone (a live
peer's stays; another host's, on a shared filesystem, too). Torch-free: the master sweeps its run's exports.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
from pathlib import Path

EXPORTS = "exports"  # a run directory's folder of --export-every exports: exports/iter_XXXXXXXX/MODEL


def part_name(out: Path) -> Path:
    """A temporary folder of this process's own beside ``out``: a peer exporting to it at once has another."""
    return out.with_name(f".{out.name}.part-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def remove_dead_parts(folder: Path, name: str = "*") -> list[Path]:
    """Remove the stale temporary folders (see the module docstring) of exports to ``folder / name`` (any name by
    default); returns them."""
    host, removed = socket.gethostname(), []
    for p in folder.glob(f".{glob.escape(name) if name != '*' else '*'}.part-*") if folder.is_dir() else []:
        who, pid = p.name.rpartition(".part-")[2].rsplit("-", 1)[0].rpartition("-")[::2]
        if who == host and pid.isdigit() and not _alive(int(pid)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def remove_dead_exports(run_root: Path) -> list[Path]:
    """A run's (or a resumed run's) sweep of its ``exports/iter_*/`` (and of the earlier histories a run set aside,
    ``exports/replaced-*/iter_*/``): the stale temporary folders an earlier master of this run directory left when
    it was killed mid-export. The next export to the same folder would remove them, but a resumed run exports to
    other folders. An ``iter_*`` folder left empty by the sweep goes too."""
    root = run_root / EXPORTS
    removed: list[Path] = []
    for folder in sorted([*root.glob("iter_*"), *root.glob("replaced-*/iter_*")]) if root.is_dir() else []:
        gone = remove_dead_parts(folder)
        if gone and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        removed += gone
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
