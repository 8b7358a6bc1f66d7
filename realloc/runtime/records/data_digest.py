"""The dataset files a run reads, by their size and SHA-256, so that ``--resume`` refuses a dataset edited since
the checkpoint's run (its batches would differ silently: iteration t's batch is a function of the file's rows).

``realloc run`` hashes each file once, when it writes run.json; every checkpoint's meta.json copies those digests
(``run_settings.checkpoint_settings``), and a resume hashes the files once more to compare.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

from realloc.api import ExperimentSpec

CHUNK = 1 << 20  # a large dataset is read in pieces, never whole into memory


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def data_files(spec: ExperimentSpec) -> tuple[str, ...]:
    """The training dataset and the evaluation dataset the run reads, resolved as ``RunConfig.of`` resolves them
    (read here from the config itself: records/ sits below inputs/)."""
    cfg = spec.config
    named = (getattr(cfg, "dataset", None), getattr(getattr(cfg, "eval", None), "dataset", None))
    return tuple(dict.fromkeys(str(spec.resolve_path(p)) for p in named if isinstance(p, (str, Path)) and str(p)))


def data_digests(spec: ExperimentSpec) -> dict[str, dict[str, Any]]:
    """Path -> {bytes, sha256} of each of ``data_files`` that exists (a missing one is the loader's error)."""
    out: dict[str, dict[str, Any]] = {}
    for name in data_files(spec):
        path = Path(name)
        if path.is_file():
            out[name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    return out


def data_differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The dataset files of ``before`` (a checkpoint's run) whose content differs in ``after`` (the resume's). A
    file the resume reads instead of another is a setting's difference (``dataset: a -> b``), named there."""
    out = []
    for name, was in sorted(before.items()):
        now = after.get(name)
        if now is None:
            if not Path(name).is_file():
                out.append(f"dataset {name}: no longer exists")
        elif not isinstance(was, Mapping) or was.get("sha256") != now["sha256"]:
            size = was.get("bytes") if isinstance(was, Mapping) else None
            out.append(f"dataset {name}: its content changed since the checkpoint's run ({size} -> {now['bytes']} "
                       f"bytes), so its batches would differ")
    return out
