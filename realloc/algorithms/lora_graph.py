"""LoRA in the dataflow graph (torch-free): which models get adapters, and the reference that is the base.

An experiment turns LoRA on with a ``lora`` field (or property) holding a ``LoRAConfig``; its ``models`` name the
trained models that get adapters (default ``("actor",)``)::

    lora: LoRAConfig = LoRAConfig(rank=8, alpha=16)          # --set lora.rank=16 changes it

    @property
    def rpcs(self):
        return reference_from_base(critic_free_rpcs("grpo", reward="rule", ...))

The reference model of a LoRA actor is the actor's own frozen base: ``reference_from_base`` moves the calls of
model ``ref`` onto model ``actor`` with ``interface_args={"adapters": "off"}``, which the worker runs with the
adapters switched off. The graph then has no reference model to place, load or reallocate; the search places
the reference inference like any other call of the actor (on the actor's layout when that is cheapest).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from realloc.calls import InterfaceType, ModelFunctionCallDef
from realloc.models.config import ModelConfig
from realloc.models.lora_config import LoRAConfig

ADAPTERS_ARG = "adapters"  # interface_args key: "off" runs the call on the base model


def adapters_off(call: ModelFunctionCallDef) -> bool:
    """Whether ``call`` runs its model with the LoRA adapters switched off."""
    return call.interface_args.get(ADAPTERS_ARG, "on") == "off"


def reference_from_base(rpcs: Iterable[ModelFunctionCallDef], actor: str = "actor",
                        ref: str = "ref") -> list[ModelFunctionCallDef]:
    """``rpcs`` with every call of model ``ref`` moved to model ``actor`` and run with its adapters off."""
    out = []
    for r in rpcs:
        if r.model_name == ref:
            args = {**r.interface_args, ADAPTERS_ARG: "off"}
            r = dataclasses.replace(r, model_name=actor, model_type=None, interface_args=args)
        out.append(r)
    return out


def lora_setting(experiment: Any, name: str) -> LoRAConfig | None:
    """The experiment's ``lora`` field, checked."""
    value = getattr(experiment, "lora", None)
    if value is None or isinstance(value, LoRAConfig):
        return value
    raise ValueError(f"experiment {name}: `lora` must be a LoRAConfig (realloc.api.LoRAConfig) or None, got "
                     f"{type(value).__name__}")


def apply_lora(name: str, rpcs: tuple[ModelFunctionCallDef, ...], configs: dict[str, ModelConfig | None],
               lora: LoRAConfig | None) -> None:
    """Give the models of ``lora.models`` their adapters (in ``configs``, in place), and check every call's
    ``adapters`` argument."""
    trained = {r.model_name for r in rpcs if r.is_train}
    if lora is not None:
        for m in lora.models:
            if m not in configs:
                raise ValueError(f"experiment {name}: lora.models names {m!r}, which no call uses (models: "
                                 f"{', '.join(configs)})")
            cfg = configs[m]
            if cfg is None:
                raise ValueError(f"experiment {name}: lora.models names {m!r}, a parameter-free rule; LoRA adapts "
                                 f"a trained model")
            if m not in trained:
                raise ValueError(f"experiment {name}: lora.models names {m!r}, which no call trains; adapters on a "
                                 f"frozen model would stay at their initial value (drop it from lora.models)")
            configs[m] = dataclasses.replace(cfg, lora=lora)
    for r in rpcs:
        value = r.interface_args.get(ADAPTERS_ARG)
        if value is None:
            continue
        if value not in ("on", "off"):
            raise ValueError(f"call {r.name!r}: interface_args['{ADAPTERS_ARG}'] must be 'on' or 'off', got "
                             f"{value!r}")
        if value == "off":
            cfg = configs.get(r.model_name)
            if cfg is None or cfg.lora is None:
                raise ValueError(f"call {r.name!r}: interface_args['{ADAPTERS_ARG}']='off' runs model "
                                 f"{r.model_name!r} without its LoRA adapters, but it has none; add it to the "
                                 f"experiment's lora.models (lora: LoRAConfig(models=({r.model_name!r},)))")
            if r.interface_type is InterfaceType.TRAIN_STEP:
                raise ValueError(f"call {r.name!r}: a train step cannot run with the adapters off (they are what "
                                 f"it trains); drop interface_args['{ADAPTERS_ARG}']")
            if r.interface_type is InterfaceType.GENERATE:
                # generation may replay captured decode steps (CUDA graphs) that the adapter switch cannot reach
                raise ValueError(f"call {r.name!r}: interface_args['{ADAPTERS_ARG}']='off' is for INFERENCE calls "
                                 f"(the base model's log-probs or values); generation samples from the trained "
                                 f"model")


def lora_digest(configs: Mapping[str, ModelConfig | None]) -> dict[str, Any]:
    """The LoRA settings a plan and a checkpoint depend on, by model (empty without LoRA)."""
    return {m: dataclasses.asdict(c.lora) for m, c in configs.items() if c is not None and c.lora is not None}
