"""The nodes of a dataflow graph: ``ModelFunctionCallDef`` and its ``InterfaceType``.

They sit below both the experiment API (``api.py``) and the algorithms (``algorithms/``), which both use
them; users import them from ``realloc.api``.
"""

from __future__ import annotations

import dataclasses
import enum
from types import MappingProxyType
from typing import Any, Mapping, Sequence


class InterfaceType(str, enum.Enum):
    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"


GENERATE = InterfaceType.GENERATE
INFERENCE = InterfaceType.INFERENCE
TRAIN_STEP = InterfaceType.TRAIN_STEP


@dataclasses.dataclass(frozen=True)
class ModelFunctionCallDef:
    """One node of the dataflow graph: a call of ``interface_type`` on model ``model_name``.

    ``model_type`` may be left out on all but one call of a model; the graph
    takes it from the call that names it. ``n_minibatches`` (TRAIN_STEP only)
    splits the batch into that many optimizer steps, as PPO's mini-batches do;
    it comes from the interface's settings (``ppo.n_minibatches``), and a call
    that also gives it must give the same number (``registry.resolve_minibatches``).
    ``n_samples`` (GENERATE only) samples that many responses per prompt: the
    group that GRPO and RLOO compare. Every later call then sees
    ``batch_size * n_samples`` sequences, grouped by prompt; ``n_seqs``
    defaults to that number.
    """

    name: str
    model_name: str
    interface_type: InterfaceType
    model_type: str | None = None
    input_data: Sequence[str] = ()
    output_data: Sequence[str] = ()
    n_seqs: int | None = None
    n_minibatches: int | None = None  # TRAIN_STEP: None takes the settings' (others: 1)
    n_samples: int = 1
    interface_impl: str | None = None
    interface_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"ModelFunctionCallDef.name must be an identifier such as 'actor_gen', got {self.name!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"call {self.name!r}: model_name must be a non-empty string")
        try:
            itype = InterfaceType(self.interface_type)
        except ValueError:
            known = ", ".join(t.name for t in InterfaceType)
            raise ValueError(f"call {self.name!r}: unknown interface_type {self.interface_type!r}; "
                             f"use one of {known}") from None
        object.__setattr__(self, "interface_type", itype)
        for field in ("input_data", "output_data"):
            value = getattr(self, field)
            if isinstance(value, str):
                raise ValueError(f"call {self.name!r}: {field} must be a list of keys, not the string {value!r}")
            keys = tuple(value)
            if any(not isinstance(k, str) or not k for k in keys):
                raise ValueError(f"call {self.name!r}: {field} keys must be non-empty strings, got {keys!r}")
            if len(set(keys)) != len(keys):
                raise ValueError(f"call {self.name!r}: {field} lists a key twice: {keys!r}")
            object.__setattr__(self, field, keys)
        if self.n_seqs is not None and (not isinstance(self.n_seqs, int) or self.n_seqs < 1):
            raise ValueError(f"call {self.name!r}: n_seqs must be a positive integer, got {self.n_seqs!r}")
        if self.n_minibatches is None and itype is not InterfaceType.TRAIN_STEP:
            object.__setattr__(self, "n_minibatches", 1)
        if self.n_minibatches is not None and (not isinstance(self.n_minibatches, int) or
                                               isinstance(self.n_minibatches, bool) or self.n_minibatches < 1):
            raise ValueError(f"call {self.name!r}: n_minibatches must be a positive integer, got {self.n_minibatches!r}")
        if self.n_minibatches != 1 and itype is not InterfaceType.TRAIN_STEP:
            raise ValueError(f"call {self.name!r}: n_minibatches applies only to TRAIN_STEP calls")
        if not isinstance(self.n_samples, int) or isinstance(self.n_samples, bool) or self.n_samples < 1:
            raise ValueError(f"call {self.name!r}: n_samples must be a positive integer, got {self.n_samples!r}")
        if self.n_samples > 1 and itype is not InterfaceType.GENERATE:
            raise ValueError(f"call {self.name!r}: n_samples (responses per prompt) applies only to GENERATE calls")
        object.__setattr__(self, "interface_args", MappingProxyType(dict(self.interface_args)))

    @property
    def is_train(self) -> bool:
        return self.interface_type is InterfaceType.TRAIN_STEP
