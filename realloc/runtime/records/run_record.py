"""How a run was made, recorded in its directory so that it can be reproduced and continued.

``realloc run`` writes, besides the run's outputs::

    run.json                     the experiment, the overrides in force (``--resume`` reapplies them) and one
                                 entry per session (the first run and each resume): when, the command line,
                                 the checkpoint it resumed, the ``--set`` it was given, what it changed, and
                                 the package versions and git revisions it ran with
    config/experiment.json       the fully resolved experiment: every field of the experiment dataclass with
                                 the overrides applied and the defaults filled in, the workload, the cluster,
                                 every call and model
    config/source/               a copy of the experiment file and the modules beside it that it imported
    config/environment.json      the latest session's package versions, Python, host and git revisions

A resumed session appends to run.json's ``sessions``; when its experiment files differ from the copy, the
earlier copy is kept as ``config/source.session<N>/`` (N: the session that ran with it). The checkpoint
itself records the overrides and the resolved experiment (``persist/run_settings.py``), so ``--resume`` can
tell a changed setting even from a checkpoint copied out of its run directory.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata
import json
import math
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from realloc.api import ExperimentSpec
from realloc.runtime.records.data_digest import data_digests
from realloc.runtime.records.run_paths import naming

if TYPE_CHECKING:
    from realloc.graph.dataflow import DataflowGraph

RUN_JSON = "run.json"
CONFIG_DIR = "config"
PACKAGES = ("realloc", "torch", "megatron-core", "numpy", "safetensors", "transformers", "tokenizers", "pyzmq",
            "pydantic", "networkx", "rich", "tensorboard", "wandb", "ray")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address differs per process: not a setting
_MAX_DEPTH = 16
# Sections of a resolved experiment that follow from the others (the run settings from the config, as resolved
# where the experiment file is; the interfaces from the calls): a change shows once, where the user made it.
DERIVED = ("run", "interfaces")


def jsonable(x: Any, depth: int = 0) -> Any:
    """``x`` as JSON values, every field of every dataclass included; functions and classes by their import
    name, other objects by their type and attributes (a reward object's settings), never by address."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if depth > _MAX_DEPTH:
        return _ADDRESS.sub("", repr(x))
    if isinstance(x, enum.Enum):
        return x.name
    if isinstance(x, Path):
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name, None), depth + 1) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {str(k): jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, depth + 1) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((jsonable(v, depth + 1) for v in x), key=repr)
    if isinstance(x, type) or callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', '?')}.{x.__qualname__}"
    if hasattr(x, "__dict__") and not isinstance(x, type(sys)):
        return {"type": f"{type(x).__module__}.{type(x).__qualname__}",
                **{k: jsonable(v, depth + 1) for k, v in sorted(vars(x).items()) if not k.startswith("_")}}
    return _ADDRESS.sub("", repr(x))


def resolved_experiment(spec: ExperimentSpec, graph: "DataflowGraph | None" = None,
                        run_config: Any = None) -> dict[str, Any]:
    """Every setting the run trains with: the experiment dataclass's fields (``--set`` keys; defaults filled
    in), the workload, the cluster, the calls and the models; with ``graph``, what each call runs and the
    settings of each interface the experiment has no field for (the type's defaults, as its calls read them:
    ``settings``); with ``run_config`` (a ``RunConfig``), the run settings as resolved (``run``: dataset and
    tokenizer paths on this machine, sample and eval schedule)."""
    out = {"experiment": spec.name,
           "config": jsonable(spec.config) if spec.config is not None else {},
           "workload": {"batch_size": spec.batch_size, "prompt_len": spec.prompt_len, "gen_len": spec.gen_len,
                        "max_staleness": spec.max_staleness},
           "cluster": jsonable(spec.cluster),
           "calls": {r.name: jsonable(r) for r in spec.rpcs},
           "models": jsonable(dict(spec.models)),
           "dataset_keys": list(spec.dataset_keys)}
    if graph is not None:
        # An interface's settings the experiment has no field for: the type's defaults (the others are in config).
        out["settings"] = {i.config: jsonable(i.settings(spec.config)) for i in graph.interfaces.values()
                           if i.config is not None and getattr(spec.config, i.config, None) is None}
        out["interfaces"] = {call: f"{i.name} ({i.type.value})" for call, i in graph.interfaces.items()}
    if run_config is not None:
        out["run"] = jsonable(run_config)
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def _key(path: str) -> str:
    """A flattened key as the user writes it: ``--set`` keys for the config and the workload."""
    path = path.rstrip(".")
    for head in ("config.", "workload."):
        if path.startswith(head):
            return path[len(head):]
    return path


def differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting of two resolved experiments that differs, in key order.

    A key on one side only is a difference when its parent is a value on the other (an empty dict that got
    entries, a number that became a group); otherwise it is a field one realloc version records and the other
    does not (a new algorithm option with its default), which no user changed: an edit of the experiment's
    own fields shows in its file's digest (``source_differences``). ``DERIVED`` sections are not compared."""
    a, b = ({k: v for k, v in _flatten(dict(d)).items() if k.split(".")[0] not in DERIVED} for d in (before, after))
    out = []
    for k in sorted(set(a) | set(b)):
        if k in a and k in b:
            changed = a[k] != b[k]
        else:
            other = b if k in a else a
            changed = any(p in other for p in _parents(k))
        if changed:
            out.append(f"{_key(k)}: {_show(a.get(k, '<unset>'))} -> {_show(b.get(k, '<unset>'))}")
    return out


def _parents(key: str) -> list[str]:
    """The flattened keys a parent of ``key`` has as a leaf: ``a.b.`` (an empty dict) or ``a.b`` (a value)."""
    parts = key.rstrip(".").split(".")
    return [f"{'.'.join(parts[:i])}{end}" for i in range(1, len(parts)) for end in (".", "")]


def _show(v: Any) -> str:
    text = v if isinstance(v, str) and v == "<unset>" else json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the experiment's files -----------------------------------------------------------------------------------
def experiment_files(spec: ExperimentSpec) -> tuple[Path | None, list[Path]]:
    """(the folder the experiment's files are copied relative to, those files): the experiment file and every
    module loaded from its folder or below (the user's own modules it imports). A shipped experiment named as a
    module (``realloc....``) has only its own file; an unknown source, none."""
    target = spec.source.rsplit(":", 1)[0] if ":" in spec.source else spec.source
    if target.endswith(".py"):
        main = Path(target).resolve()
    else:
        module = sys.modules.get(target)
        file = getattr(module, "__file__", None)
        if not file:
            return None, []
        main = Path(file).resolve()
    if not main.is_file():
        return None, []
    base = main.parent
    package_root = Path(__file__).resolve().parents[2]  # realloc/: its own modules are not the user's
    files = {main}
    if not base.is_relative_to(package_root):
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if not file or not file.endswith(".py") or name.startswith("realloc_experiment_"):
                continue  # another experiment file this process loaded (api._import_file's names) is not this one's
            if "site-packages" in file:
                continue  # an installed package's (most of the thousands torch brings): no path to resolve
            p = Path(file).resolve()
            if p.is_relative_to(base) and p.is_file() and "site-packages" not in p.parts:
                files.add(p)
    return base, sorted(files)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_digests(spec: ExperimentSpec) -> dict[str, str]:
    """The experiment's files (``experiment_files``) by path relative to the experiment's folder: SHA-256."""
    base, files = experiment_files(spec)
    return {f.relative_to(base).as_posix(): sha256_file(f) for f in files} if base else {}


def source_differences(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The experiment's files that changed, appeared or went between two ``source_digests``."""
    out = []
    for name in sorted(set(before) | set(after)):
        if name not in after:
            out.append(f"file {name}: no longer imported")
        elif name not in before:
            out.append(f"file {name}: newly imported")
        elif before[name] != after[name]:
            out.append(f"file {name}: its content changed")
    return out


# -- versions and revisions ------------------------------------------------------------------------------------
def git_revision(folder: Path) -> dict[str, Any] | None:
    """The commit checked out where ``folder`` is, and whether tracked files differ from it; None outside git."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status), "root": git("rev-parse", "--show-toplevel")}


def environment(spec: ExperimentSpec) -> dict[str, Any]:
    """Python, host, the installed versions of the packages a run depends on, and the git revisions of
    realloc's source and of the experiment's folder (None where not a git checkout)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    base, _ = experiment_files(spec)
    return {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "host": socket.gethostname(), "packages": versions,
            "git": {"realloc": git_revision(Path(__file__).resolve().parent),
                    "experiment": git_revision(base) if base else None}}


# -- writing the record ------------------------------------------------------------------------------------------
def read_run_json(root: Path) -> dict[str, Any]:
    """run.json of a run directory ({} when missing); one error naming the file when it is not ours to extend."""
    path = root / RUN_JSON
    if not path.is_file():
        return {}
    try:
        body = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix it or move it away (it holds the run's settings "
                         f"and history)") from None
    if not isinstance(body, dict):
        raise ValueError(f"{path} holds a JSON {type(body).__name__}, not the run's settings; fix or move it away")
    return body


@dataclasses.dataclass(frozen=True)
class Session:
    """One ``realloc run`` of a run directory: what it was asked and what it resumed."""

    experiment: str
    overrides: tuple[str, ...]  # in force: the recorded ones a resume reapplies, then this command's
    given: tuple[str, ...]  # this command's --set
    resumed_from: str | None = None
    first_iteration: int = 1
    last_iteration: int = 0
    changed: tuple[str, ...] = ()  # settings that differ from the checkpoint's run (--allow-changed-settings)
    data: Mapping[str, Any] | None = None  # the dataset files' digests if known (a resume's), else hashed here


def write_run_record(root: Path, spec: ExperimentSpec, session: Session, argv: Sequence[str] | None = None,
                     resolved: Mapping[str, Any] | None = None) -> None:
    """run.json (with this session appended to the history), config/experiment.json (``resolved``, by default
    ``resolved_experiment(spec)``), config/environment.json and config/source/ (see the module docstring)."""
    recorded = read_run_json(root)
    sessions = list(recorded.get("sessions") or [])
    if recorded and not sessions:  # a run.json written before realloc kept sessions: its run was the first
        sessions.append({"session": 1, "experiment": recorded.get("experiment"),
                         "overrides": recorded.get("overrides", [])})
    number = len(sessions) + 1
    env = environment(spec)
    digests = source_digests(spec)
    sessions.append({"session": number, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "argv": list(argv if argv is not None else sys.argv), "experiment": session.experiment,
                     "given": list(session.given), "overrides": list(session.overrides),
                     "resumed_from": session.resumed_from,
                     "iterations": [session.first_iteration, session.last_iteration],
                     "changed": list(session.changed), "sources": digests,
                     "data": dict(session.data) if session.data is not None else data_digests(spec),
                     "packages": env["packages"], "git": env["git"]})
    body = {"experiment": session.experiment, "overrides": list(session.overrides), "sessions": sessions}
    config = root / CONFIG_DIR
    config.mkdir(parents=True, exist_ok=True)
    body_resolved = resolved if resolved is not None else resolved_experiment(spec)
    for name, what in (("experiment.json", body_resolved), ("environment.json", env)):
        with naming(config / name):
            (config / name).write_text(json.dumps(what, indent=2) + "\n")
    _copy_sources(spec, config, digests, number)
    with naming(root / RUN_JSON):
        (root / RUN_JSON).write_text(json.dumps(body, indent=2) + "\n")


def _copy_sources(spec: ExperimentSpec, config: Path, digests: Mapping[str, str], session: int) -> None:
    dest = config / "source"
    base, files = experiment_files(spec)
    if dest.is_dir():
        before = {p.relative_to(dest).as_posix(): sha256_file(p) for p in dest.rglob("*") if p.is_file()}
        if before == dict(digests):
            return
        keep = config / f"source.session{session - 1}"  # the files the sessions before this one ran with
        shutil.rmtree(keep, ignore_errors=True)
        dest.rename(keep)
    dest.mkdir(parents=True)
    for f in files:
        assert base is not None
        target = dest / f.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)


def data_record(stats: Any, spec: ExperimentSpec) -> dict[str, Any]:
    """data.json: what loading the dataset kept and cut (``LoadStats``), with the run's real ``gen_len``
    (``LoadStats.gen_len`` is the response limit a dataset with responses was cut to; 0 for prompts)."""
    body = {**dataclasses.asdict(stats), "n_too_long": stats.n_too_long,
            "n_response_too_long": stats.n_response_too_long}
    body["has_responses"] = bool(stats.gen_len)
    body["gen_len"] = spec.gen_len
    return body
