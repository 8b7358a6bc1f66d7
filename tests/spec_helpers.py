"""Experiments that tests write inline: a call list (and its interfaces) wrapped into an @auto dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.algorithms.registry import Interface
from realloc.api import GENERATE, TRAIN_STEP, ExperimentSpec, ModelFunctionCallDef, auto, experiment_spec

# Interfaces of the estimator's fixtures: only their shapes are priced, nothing is executed.
COST_ONLY_INTERFACES = [
    Interface("gen_seq", GENERATE, "realloc.algorithms.common:actor_generate", inputs=("prompts",), outputs=("seq",),
              config="ppo", config_type=PPOConfig),
    Interface("train_on_ref", TRAIN_STEP, "realloc.algorithms.ppo.ppo_interfaces:actor_train",
              inputs=("seq", "ref_logp:logp"), config="ppo", config_type=PPOConfig),
]


def inline_spec(rpcs: Iterable[ModelFunctionCallDef], interfaces: Iterable[Interface] = (),
                attrs: dict[str, Any] | None = None, **auto_fields: Any) -> ExperimentSpec:
    """The experiment of ``rpcs`` on 2 local CPU devices, batch 8, prompt 8 + 8 generated unless ``auto_fields``
    say otherwise; ``attrs`` become class attributes of the experiment (models, tokenizer, dataset, ...)."""
    fields = {"nodelist": "localhost", "n_devices_per_node": 2, "device": "cpu", "batch_size": 8, "prompt_len": 8,
              "gen_len": 8, **auto_fields}
    calls, ifaces = list(rpcs), list(interfaces)

    @auto(**fields)
    @dataclasses.dataclass
    class Exp:
        @property
        def rpcs(self):
            return list(calls)

        @property
        def interfaces(self):
            return list(ifaces)

    for k, v in (attrs or {}).items():
        setattr(Exp, k, v)
    return experiment_spec(Exp)
