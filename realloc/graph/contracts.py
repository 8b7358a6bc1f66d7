"""Interface contracts: every call against the interface it runs, before anything is planned or launched.

For each call (``registry.Interface`` declares the contract):
- its ``interface_impl`` implements its interface type;
- it lists one key per declared slot, in order (``input_data``, ``output_data``), so a graph that
  lacks a key (a critic-free graph calling PPO's train step, say) fails here, naming the slot;
- its model has the head the interface needs (vocabulary, scalar, or none for a rule function), and a
  TRAIN_STEP has parameters to train;
- the GENERATE calls sample at least the responses per prompt the interface needs (``min_group_size``);
- every key is read as the kind its producer writes (``seq`` where a ``seq`` was produced, ...), and
  all readers of one dataset key agree on what the dataset supplies.

And every settings object on the experiment (a ``TrainConfig``, or the settings type of an interface) is
read by some call's interface: a misspelled field (``gpro:`` for ``grpo:``) would otherwise run on defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from realloc.algorithms.registry import Interface, Table, lookup
from realloc.algorithms.train_config import TrainConfig
from realloc.api import ExperimentSpec, InterfaceType, ModelFunctionCallDef
from realloc.models.config import ModelConfig

HEAD_NAMES = {"lm": "a vocabulary (language-model) head", "value": "a scalar (value/reward) head",
              "none": "no model (a parameter-free rule function)"}


def _model_head(cfg: ModelConfig | None) -> str:
    return "none" if cfg is None else "value" if cfg.is_critic else "lm"


def _slots_text(slots: tuple) -> str:
    return ", ".join(map(str, slots)) or "none"


def _check_arity(r: ModelFunctionCallDef, i: Interface) -> None:
    for field, slots, keys in (("input_data", i.in_slots, r.input_data), ("output_data", i.out_slots, r.output_data)):
        if len(keys) == len(slots):
            continue
        verb = "reads" if field == "input_data" else "writes"
        what = f"{i.name!r} {i.type.name} {verb} {len(slots)} key(s), one per slot in this order: {_slots_text(slots)}"
        if len(keys) < len(slots):
            missing = slots[len(keys)]
            raise ValueError(f"call {r.name!r}: {field} has no key for slot {missing.role!r} ({what}; the call lists "
                             f"{list(keys)}); add it, or use an interface that does not need it")
        raise ValueError(f"call {r.name!r}: {field} lists {len(keys)} key(s) {list(keys)} but {what}")


def _check_group_size(spec: ExperimentSpec, r: ModelFunctionCallDef, i: Interface) -> None:
    if spec.group_size >= i.min_group_size:
        return
    gens = [g.name for g in spec.rpcs if g.interface_type is InterfaceType.GENERATE]
    need = f"interface {i.name!r} {i.type.name} compares each response with the others to its prompt and needs at " \
           f"least {i.min_group_size} responses per prompt"
    if not gens:
        raise ValueError(f"call {r.name!r}: {need}, but no GENERATE call samples responses; add one with n_samples="
                         f"{i.min_group_size} or more")
    raise ValueError(f"call {r.name!r}: {need}, but GENERATE call {gens[0]!r} samples n_samples={spec.group_size}; set "
                     f"n_samples to {i.min_group_size} or more on {gens[0]!r} (e.g. critic_free_rpcs(..., "
                     f"n_samples=8))")


def _settings_fields(config: Any, table: Table) -> dict[str, Any]:
    """The experiment's fields (and class attributes) that hold a settings object: a ``TrainConfig`` or the
    settings type of some interface. Properties are not evaluated."""
    types = tuple({i.config_type for i in table.values() if i.config_type is not None
                   and dataclasses.is_dataclass(i.config_type)} | {TrainConfig})
    names = [n for klass in reversed(type(config).__mro__) for n, v in vars(klass).items() if isinstance(v, types)]
    names += [n for n, v in getattr(config, "__dict__", {}).items() if isinstance(v, types)]
    return {n: getattr(config, n) for n in dict.fromkeys(names) if not n.startswith("_")}


def _check_settings_are_read(spec: ExperimentSpec, table: Table, chosen: Mapping[str, Interface]) -> None:
    read = sorted({i.config for i in chosen.values() if i.config is not None})
    for name, value in _settings_fields(spec.config, table).items():
        if name in read:
            continue
        close = difflib.get_close_matches(name, read, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"experiment {spec.name}: field {name!r} holds a {type(value).__name__}, but no call's "
                         f"interface reads it (they read: {', '.join(read) or 'no settings'}), so it would change "
                         f"nothing; {hint}rename or remove it")


def check_contracts(spec: ExperimentSpec, table: Table,
                    configs: Mapping[str, ModelConfig | None]) -> dict[str, Interface]:
    """The interface of every call; raises one ValueError naming the call and the slot or key at fault."""
    chosen: dict[str, Interface] = {}
    owners: dict[str, list] = {}  # config name -> [(call, its check_experiment)]
    for r in spec.rpcs:
        cfg = configs[r.model_name]
        if cfg is None and r.is_train:
            raise ValueError(f"call {r.name!r}: model {r.model_name!r} is a parameter-free rule (model_type 'rule'), "
                             f"which a TRAIN_STEP cannot train; run the train step on a model with parameters")
        if cfg is None and r.interface_impl is None:
            raise ValueError(f"call {r.name!r}: a parameter-free 'rule' model needs interface_impl (e.g. "
                             f"'rule_reward')")
        i = lookup(table, r, cfg is not None and cfg.is_critic)
        have = _model_head(cfg)
        if i.head != have:
            raise ValueError(f"call {r.name!r}: interface {i.name!r} {i.type.name} needs {HEAD_NAMES[i.head]}, but "
                             f"model {r.model_name!r} has {HEAD_NAMES[have]}")
        _check_arity(r, i)
        _check_group_size(spec, r, i)
        i.check(r.name, r.interface_args)
        settings = i.settings(spec.config)  # the experiment's settings for it have the right type
        if r.is_train and settings.grad_dtype == "bf16" and spec.cluster.hardware.dtype == "fp32":
            # bf16 gradient buffers are for bf16 models (engine.make_optimizer); say so before any worker starts
            raise ValueError(f"call {r.name!r}: {i.config}.grad_dtype='bf16' needs a bf16 model, but the cluster's "
                             f"{spec.cluster.device} devices train in fp32; set {i.config}.grad_dtype to fp32")
        check = getattr(settings, "check_experiment", None)  # settings that depend on the experiment's shape
        if callable(check):
            owners.setdefault(i.config, []).append((r, check))
        chosen[r.name] = i
    # Each config once, named after the call that owns it: its train call (the one a user tunes), else the first.
    for calls in owners.values():
        r, check = next(((r, c) for r, c in calls if r.is_train), calls[0])
        check(spec, r.name, chosen[r.name].config)
    _check_settings_are_read(spec, table, chosen)
    # What each key holds, from its producer's output slot (or the first reader of a dataset key).
    kinds: dict[str, tuple[str, str]] = {}  # key -> (kind, who says so)
    for r in spec.rpcs:
        for slot, key in zip(chosen[r.name].out_slots, r.output_data):
            kinds[key] = (slot.kind, f"call {r.name!r} writes it as {slot}")
    for r in spec.rpcs:
        for slot, key in zip(chosen[r.name].in_slots, r.input_data):
            if key not in kinds:  # a dataset key: its first reader says what the dataset must supply
                kinds[key] = (slot.kind, f"call {r.name!r} reads it from the dataset as {slot}")
                continue
            kind, why = kinds[key]
            if kind != slot.kind:
                raise ValueError(f"call {r.name!r} reads key {key!r} as its slot {slot.role!r} (kind {slot.kind!r}), "
                                 f"but {why} (kind {kind!r}); check the order of input_data against "
                                 f"{chosen[r.name].name!r}'s slots: {_slots_text(chosen[r.name].in_slots)}")
    data_kinds = {kinds[k][0] for k in spec.dataset_keys if k in kinds}
    if len(data_kinds) > 1:
        raise ValueError(f"experiment {spec.name}: its calls read {' and '.join(sorted(data_kinds))} from the dataset, "
                         f"but one experiment reads one dataset; " +
                         "; ".join(kinds[k][1] for k in spec.dataset_keys if k in kinds))
    return chosen
