"""``Interface``: one implementation of one interface type, with its data contract (see ``registry.py``)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Literal

from realloc.algorithms.train_config import TrainConfig
from realloc.calls import InterfaceType

HEADS = ("lm", "value", "none")


@dataclasses.dataclass(frozen=True)
class Slot:
    role: str
    kind: str

    @classmethod
    def parse(cls, text: str) -> "Slot":
        role, _, kind = text.partition(":")
        return cls(role, kind or role)

    def __str__(self) -> str:
        return self.role if self.kind == self.role else f"{self.role} ({self.kind})"


@dataclasses.dataclass(frozen=True)
class Interface:
    name: str
    type: InterfaceType
    fn: str | Callable[..., Any]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    head: Literal["lm", "value", "none"] = "lm"
    config: str | None = None  # the experiment field with this interface's settings
    config_type: type | None = None
    lr: str = "lr"  # TRAIN_STEP: the settings' field that holds the learning rate
    records: bool = False  # reads the dataset record of each sequence (e.g. a reference answer)
    rows_per_seq: int = 1  # model rows per sequence, for the cost estimate (a DPO pair: chosen + rejected)
    min_group_size: int = 1  # fewest responses per prompt it needs (a group baseline needs 2)
    # Checks a call's interface_args at `realloc show`, before anything runs: (call name, args) -> None, raising
    # ValueError; a function or "module:function" (torch-free, like the registry)
    check_args: str | Callable[..., Any] | None = None
    # GENERATE: whether a call can migrate its long tail (graph/tail.py): it generates once, through
    # common.actor_generate, so its rows can stop at a migration point and continue elsewhere. A rollout that
    # generates turn by turn (multi-turn) cannot.
    migrates_tail: bool = True
    # GENERATE that cannot migrate: its stepwise form, (ctx, inputs) -> an object that runs the call turn by turn
    # (``until`` a split point, ``running``, ``finish``, ``result`` of rows; multiturn.TurnRollouts), a class or
    # "module:Class". With one, the call can stream its finished rows (a stream-only tail entry, worker_stream.py).
    stepwise: str | Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        where = f"Interface {self.name!r}"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"{where}: the name must be an identifier such as 'grpo_actor'")
        try:
            object.__setattr__(self, "type", InterfaceType(self.type))
        except ValueError:
            raise ValueError(f"{where}: type must be GENERATE, INFERENCE or TRAIN_STEP, got {self.type!r}") from None
        for field in ("inputs", "outputs"):
            slots = getattr(self, field)
            if isinstance(slots, str) or not all(isinstance(s, str) and s and s.count(":") <= 1 for s in slots):
                raise ValueError(f"{where}: {field} must be a list of slot names ('role' or 'role:kind')")
            object.__setattr__(self, field, tuple(slots))
        if self.head not in HEADS:
            raise ValueError(f"{where}: head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if not (callable(self.fn) or (isinstance(self.fn, str) and ":" in self.fn)):
            raise ValueError(f"{where}: fn must be a function or 'module:function'")
        if self.check_args is not None and not (callable(self.check_args) or
                                                 (isinstance(self.check_args, str) and ":" in self.check_args)):
            raise ValueError(f"{where}: check_args must be a function or 'module:function'")
        if (self.config is None) != (self.config_type is None):
            raise ValueError(f"{where}: give config (the experiment field) and config_type together")
        if not isinstance(self.min_group_size, int) or isinstance(self.min_group_size, bool) or self.min_group_size < 1:
            raise ValueError(f"{where}: min_group_size must be a positive integer, got {self.min_group_size!r}")
        if self.type is InterfaceType.TRAIN_STEP and self.head == "none":
            raise ValueError(f"{where}: a TRAIN_STEP interface trains a model's parameters, so head must be 'lm' or "
                             f"'value', not 'none' (a parameter-free function can only be GENERATE or INFERENCE)")
        if self.type is InterfaceType.TRAIN_STEP and not (isinstance(self.config_type, type)
                                                         and issubclass(self.config_type, TrainConfig)):
            raise ValueError(f"{where}: a TRAIN_STEP interface needs settings with its optimizer: config_type must "
                             f"be a realloc.algorithms.train_config.TrainConfig subclass")

    @property
    def key(self) -> tuple[str, InterfaceType]:
        return (self.name, self.type)

    @property
    def in_slots(self) -> tuple[Slot, ...]:
        return tuple(Slot.parse(s) for s in self.inputs)

    @property
    def out_slots(self) -> tuple[Slot, ...]:
        return tuple(Slot.parse(s) for s in self.outputs)

    def resolve(self) -> Callable[..., Any]:
        """The implementation (imports its module on first use)."""
        if callable(self.fn):
            return self.fn
        module, _, attr = self.fn.partition(":")
        return getattr(importlib.import_module(module), attr)

    def resolve_stepwise(self) -> Callable[..., Any] | None:
        """The stepwise form (imports its module on first use), or None."""
        if self.stepwise is None or callable(self.stepwise):
            return self.stepwise
        module, _, attr = self.stepwise.partition(":")
        return getattr(importlib.import_module(module), attr)

    def check(self, call: str, args: Any) -> None:
        """Run ``check_args`` on a call's ``interface_args`` (nothing when the interface has none)."""
        if self.check_args is None:
            return
        fn = self.check_args
        if isinstance(fn, str):
            module, _, attr = fn.partition(":")
            fn = getattr(importlib.import_module(module), attr)
        fn(call, args)

    def settings(self, experiment: Any) -> Any:
        """This interface's settings object of an experiment instance (the type's defaults when absent)."""
        if self.config is None:
            return None
        value = getattr(experiment, self.config, None)
        if value is None:
            return self.config_type()
        if not isinstance(value, self.config_type):
            raise ValueError(f"experiment field {self.config!r} must be a {self.config_type.__name__} (interface "
                             f"{self.name!r}), got {type(value).__name__}")
        return value
