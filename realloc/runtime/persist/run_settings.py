"""The settings a checkpoint was trained with, and what ``--resume`` does with them.

Every checkpoint's meta.json records ``settings``: the ``--set`` overrides in force, the fully resolved
experiment (``records/run_record.resolved_experiment``) and the SHA-256 of the experiment's files. Resuming
reapplies those overrides (a ``--set`` given again replaces its own key), resolves the experiment again and
compares: any setting that differs (a new ``--set``, an edited experiment file, another default) is refused
in one error naming each difference, unless the user passes ``--allow-changed-settings``; then the
differences are printed and recorded in run.json. A checkpoint written before realloc recorded settings
falls back to its run directory's run.json, and compares the overrides only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from realloc.api import ExperimentSpec
from realloc.overrides import load_with_overrides, parse_sets
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.records.data_digest import data_differences, data_digests
from realloc.runtime.records.run_record import (RUN_JSON, differences, read_run_json, resolved_experiment,
                                                source_differences, source_digests)

if TYPE_CHECKING:
    from realloc.models.config import ModelConfig

ALLOW_FLAG = "--allow-changed-settings"


def full_resolved(spec: ExperimentSpec) -> dict[str, Any]:
    """``resolved_experiment`` with the graph's interface settings and the resolved ``RunConfig``: what the run
    records in config/experiment.json and every checkpoint, and what ``--resume`` compares."""
    from realloc.graph.dataflow import build_graph

    return json.loads(json.dumps(resolved_experiment(spec, build_graph(spec), RunConfig.of(spec))))


def checkpoint_settings(spec: ExperimentSpec, run_root: Path, resolved: Mapping[str, Any] | None = None
                        ) -> dict[str, Any]:
    """meta.json's ``settings`` of a checkpoint of ``spec`` (the experiment as the master loaded it, overrides
    applied; ``resolved``: its ``full_resolved``, computed once by the caller). The overrides and the files'
    digests are run.json's, which ``realloc run`` wrote before the master started: the files as this run loaded
    them, even if someone edits them while it trains."""
    recorded = read_run_json(run_root) if (run_root / RUN_JSON).is_file() else {}
    sessions = recorded.get("sessions") or [{}]
    sources, data = sessions[-1].get("sources"), sessions[-1].get("data")
    return {"overrides": list(recorded.get("overrides", [])),
            "experiment": dict(resolved) if resolved is not None else full_resolved(spec),
            "sources": sources if isinstance(sources, dict) else source_digests(spec),
            "data": data if isinstance(data, dict) else data_digests(spec)}


def model_record(cfg: "ModelConfig", strategy: Any, source: str | None, tokenizer: str | None,
                 token_ids: Mapping[str, Any]) -> dict[str, Any]:
    """What meta.json says about one trained model, so an export needs nothing but the checkpoint (torch-free:
    the master writes it; ``export.py`` reads it)."""
    return {"config": dataclasses.asdict(cfg), "tp": strategy.tp, "pp": strategy.pp, "source": source,
            "tokenizer": tokenizer, "token_ids": dict(token_ids)}


def merge_overrides(recorded: Sequence[str], given: Sequence[str]) -> tuple[str, ...]:
    """The recorded overrides with the given ones applied on top: one ``KEY=VALUE`` per key, a given one
    replacing the recorded one of its key, in first-set order."""
    merged = {**parse_sets(recorded), **parse_sets(given)}
    return tuple(f"{k}={v}" for k, v in merged.items())


@dataclasses.dataclass(frozen=True)
class ResumedSettings:
    spec: ExperimentSpec  # the experiment with ``overrides`` applied
    overrides: tuple[str, ...]  # in force: the checkpoint's run's, then this command's
    recorded: tuple[str, ...]  # the checkpoint's run's
    changed: tuple[str, ...]  # ``key: old -> new`` per difference from the checkpoint's run (allowed by the flag)
    data: Mapping[str, Any] | None = None  # the dataset files' digests now (hashed once, recorded in run.json)


def _recorded(ckpt: Path, meta: Mapping[str, Any]
              ) -> tuple[tuple[str, ...], dict[str, Any] | None, dict | None, dict | None]:
    """(overrides, resolved experiment or None, source digests or None, dataset digests or None) of the run that
    wrote ``ckpt``."""
    settings = meta.get("settings")
    if isinstance(settings, dict) and isinstance(settings.get("overrides"), list):
        data = settings.get("data")
        return (tuple(settings["overrides"]), settings.get("experiment"), settings.get("sources"),
                data if isinstance(data, dict) else None)
    run_root = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return tuple(read_run_json(run_root).get("overrides", [])), None, None, None


def resume_settings(experiment: str, ckpt: Path, meta: Mapping[str, Any], given: Sequence[str],
                    allow_changed: bool) -> ResumedSettings:
    """The experiment a resume of ``ckpt`` trains: its run's overrides reapplied, ``given`` on top; refused when
    a setting differs from that run's unless ``allow_changed`` (one ValueError naming every difference)."""
    recorded, resolved_before, sources_before, data_before = _recorded(ckpt, meta)
    overrides = merge_overrides(recorded, given)
    try:
        spec = load_with_overrides(experiment, overrides)
    except ValueError as e:
        load_with_overrides(experiment, given)  # the command's own --set is at fault: its error as usual
        raise ValueError(f"--resume {ckpt}: the overrides of the run that wrote the checkpoint ({' '.join(recorded)}) "
                         f"no longer apply to {experiment}: {e}; the experiment changed since (resume with the "
                         f"version that wrote the checkpoint, or start a new run)") from None
    if resolved_before is not None:
        changed = differences(resolved_before, full_resolved(spec))
    else:  # an older checkpoint: only the overrides can be compared
        changed = differences(full_resolved(load_with_overrides(experiment, recorded)), full_resolved(spec))
    if sources_before is not None:
        changed += source_differences(sources_before, source_digests(spec))
    data = data_digests(spec)
    if data_before is not None:  # an edited dataset file: the resumed batches would differ silently
        changed += data_differences(data_before, data)
    if changed and not allow_changed:
        why = "; ".join(changed)
        kept = f" (its overrides, reapplied: {' '.join(recorded)})" if recorded else ""
        raise ValueError(f"--resume {ckpt}: settings differ from the run that wrote the checkpoint{kept}: {why}; "
                         f"pass {ALLOW_FLAG} to train on with them, or resume without the change")
    return ResumedSettings(spec, overrides, recorded, tuple(changed), data)
