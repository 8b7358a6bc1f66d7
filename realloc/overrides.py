"""``--set key=value``: change an experiment's fields from the command line, checked against its dataclass.

    realloc run EXP --set ppo.lr=1e-6 --set batch_size=256 --set dataset=/data/prompts.jsonl

A key is a field of the experiment dataclass, a dotted path into a nested dataclass field (``ppo.lr``,
``data.max_len``), or one of the workload fields of ``@auto`` (``batch_size``, ``prompt_len``,
``gen_len``). The value is parsed as the field's annotated type: ``int``, ``float``, ``str``, ``bool``
(true/false), ``None`` for an optional field (none/null), a ``Literal`` choice, or JSON for lists,
tuples and dicts. Anything else is one ``ValueError`` naming the key and what it accepts.

The master and every worker apply the same overrides to the experiment they load, so they agree.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any, Sequence

from realloc.api import AUTO_ATTR, ExperimentSpec, experiment_spec, load_experiment

WORKLOAD_FIELDS = ("batch_size", "prompt_len", "gen_len", "max_staleness")  # of @auto; the rest is the cluster


def load_with_overrides(target: str, sets: Sequence[str] = ()) -> ExperimentSpec:
    """``load_experiment(target)`` with ``--set`` overrides applied."""
    spec = load_experiment(target)
    return apply_overrides(spec, sets) if sets else spec


def parse_sets(sets: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--set {item!r}: write KEY=VALUE, e.g. --set ppo.lr=1e-6")
        out[key] = value.strip()
    return out


def apply_overrides(spec: ExperimentSpec, sets: Sequence[str]) -> ExperimentSpec:
    """A new spec whose config (and ``@auto`` workload) carry the ``--set`` values.

    All keys of one dataclass are replaced at once, so its validation sees them together (e.g.
    ``eval.every`` and ``eval.dataset``, in either order).
    """
    config = spec.config
    cls = type(config)
    workload: dict[str, int] = {}
    tree: dict[str, Any] = {}  # nested: field -> value text, or field -> {subfield: ...}
    for key, text in parse_sets(sets).items():
        head, _, rest = key.partition(".")
        if head in WORKLOAD_FIELDS and not rest and head not in _field_types(cls):
            workload[head] = _parse(text, int, f"--set {key}")
            continue
        node = tree
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {'.'.join(parents[:i + 1])} is also set as a whole")
        node[leaf] = (key, text)
    config = _replace(config, tree, f"experiment {spec.name}", "")
    auto = dataclasses.replace(getattr(cls, AUTO_ATTR), **workload)
    return experiment_spec(config, source=spec.source, auto_config=auto)


def _field_types(cls: type) -> dict[str, Any]:
    if not dataclasses.is_dataclass(cls):
        return {}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: fall back to the raw ones
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if f.init}


def _replace(obj: Any, tree: dict[str, Any], owner: str, prefix: str) -> Any:
    """``obj`` with the fields in ``tree`` set; ``owner`` names ``obj`` in errors, ``prefix`` is its key path."""
    fields = _field_types(type(obj))
    changes = {}
    for name, sub in tree.items():
        key = sub[0] if isinstance(sub, tuple) else f"{prefix}{name}"
        if name not in fields:
            extra = f"; workload fields: {', '.join(WORKLOAD_FIELDS)}" if not prefix else ""
            if not prefix and name == "n_samples":  # the old name of log_samples; also a call's group size
                extra += ("; samples.jsonl's count is log_samples, and responses per prompt are the GENERATE call's "
                          "n_samples (in the experiment's rpcs)")
            raise ValueError(f"--set {key}: {owner} has no field {name!r} (fields: {', '.join(fields) or 'none'}"
                             f"{extra})")
        if isinstance(sub, tuple):
            changes[name] = _parse(sub[1], fields[name], f"--set {key}")
            continue
        current = getattr(obj, name)
        if not dataclasses.is_dataclass(current):
            first = next(iter(sub))
            raise ValueError(f"--set {prefix}{name}.{first}: {name} is a {type(current).__name__}, not a group of "
                             f"fields")
        changes[name] = _replace(current, sub, f"{prefix}{name}", f"{prefix}{name}.")
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as e:  # the dataclass's own validation (__post_init__)
        sets = " ".join(f"{prefix}{n}=..." for n in changes)
        raise ValueError(f"--set {sets}: {e}") from None


def _parse(text: str, tp: Any, what: str) -> Any:
    """``text`` as a value of annotation ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return _json_or_str(text)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for a in options:
            try:
                return _parse(text, a, what)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{what}: {text!r} is none of {_name(tp)}")
    if origin is typing.Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(f"{what}: {text!r} is not one of {', '.join(map(str, args))}")
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{what}: expected true or false, got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{what}: expected an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{what}: expected a number, got {text!r}") from None
    if tp is str:
        return text
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for m in tp:
            if text in (m.name, str(m.value)):
                return m
        raise ValueError(f"{what}: {text!r} is not one of {', '.join(m.name for m in tp)}")
    if origin in (list, tuple, dict) or tp in (list, tuple, dict):
        container = origin or tp
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{what}: expected JSON for a {container.__name__}, e.g. [1, 2], got {text!r}") from None
        want = dict if container is dict else list
        if not isinstance(value, want):
            raise ValueError(f"{what}: expected a JSON {'object' if want is dict else 'array'}, got {text!r}")
        return tuple(value) if container is tuple else value
    if dataclasses.is_dataclass(tp):
        raise ValueError(f"{what}: this is a group of fields ({', '.join(f.name for f in dataclasses.fields(tp))}); "
                         f"set them one by one with dotted keys")
    raise ValueError(f"{what}: fields of type {_name(tp)} cannot be set from the command line")


def _json_or_str(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
