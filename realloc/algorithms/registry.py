"""The interface registry: what each ``interface_impl`` runs for each interface type, and its data contract.

An :class:`Interface` is one implementation of one interface type (GENERATE, INFERENCE or
TRAIN_STEP) under a name that calls use as ``interface_impl``. It declares:

- ``inputs`` / ``outputs``: its data slots, in the order of the call's ``input_data`` /
  ``output_data``. A slot is ``"role"`` or ``"role:kind"``; the kind names the tensors a key holds
  (``seq``, ``logp``, ``values``, ``rewards``, ``prompts``, ...) and defaults to the role. The
  graph checks, before anything runs, that every call lists one key per slot and that a key is
  read as the kind its producer writes (``graph/dataflow.py``).
- ``head``: the model it needs: a vocabulary head (``lm``), a scalar head (``value``), or none (a
  parameter-free rule function).
- ``config``: the experiment field holding its settings (``ppo: PPOConfig``, ``grpo: GRPOConfig``,
  ...) and the settings' type; the call receives them as ``ctx.config``. A TRAIN_STEP interface
  names the settings' field with its learning rate (``lr``), and its settings' ``n_minibatches`` is
  the call's number of optimizer steps (``resolve_minibatches``).
- ``min_group_size``: the fewest responses per prompt it works with (the GENERATE calls'
  ``n_samples``): GRPO and RLOO compare a response with the others of its group, so they need 2.
- ``fn``: ``fn(ctx: CallContext, inputs: Data) -> CallResult``, or ``"module:function"`` so that the
  registry stays torch-free (graph validation never imports torch; workers import it).

The shipped interfaces are in ``realloc/algorithms/builtin.py``. An experiment adds its own with an
``interfaces`` field or property (a list of ``Interface``); workers import the experiment file
themselves, so the function travels as code on disk, never over the network::

    def length_reward(ctx, inputs):              # any function of the experiment file
        seq = inputs["seq"]
        score = seq["gen_mask"].sum(dim=1).float() / ctx.gen_len
        return CallResult({"rewards": {"score": score}}, {"score_sum": float(score.sum()),
                                                          "n_seqs_scored": float(len(score))}, {})

    interfaces = [Interface("length_reward", INFERENCE, length_reward, inputs=("seq",),
                            outputs=("rewards",), head="none")]
"""

from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping

from realloc.algorithms.train_config import TrainConfig
from realloc.api import InterfaceType

if TYPE_CHECKING:
    from realloc.api import ExperimentSpec

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


Table = Mapping[tuple[str, InterfaceType], Interface]


def _table(interfaces: Iterable[Interface], where: str) -> dict[tuple[str, InterfaceType], Interface]:
    out: dict[tuple[str, InterfaceType], Interface] = {}
    for i in interfaces:
        if not isinstance(i, Interface):
            raise ValueError(f"{where}: expected realloc.algorithms.registry.Interface entries, got {type(i).__name__}")
        if i.key in out:
            raise ValueError(f"{where}: interface {i.name!r} {i.type.name} is declared twice")
        out[i.key] = i
    return out


def builtin_interfaces() -> Table:
    from realloc.algorithms.builtin import BUILTIN

    return MappingProxyType(_table(BUILTIN, "realloc.algorithms.builtin"))


def interfaces_of(spec: "ExperimentSpec") -> Table:
    """The shipped interfaces plus the experiment's own (``interfaces`` on the experiment)."""
    table = dict(builtin_interfaces())
    own = getattr(spec.config, "interfaces", None) or ()
    if isinstance(own, Interface) or not isinstance(own, (list, tuple)):
        raise ValueError(f"experiment {spec.name}: `interfaces` must be a list of Interface")
    for key, i in _table(own, f"experiment {spec.name}: interfaces").items():
        if key in table:
            raise ValueError(f"experiment {spec.name}: interface {i.name!r} {i.type.name} is already shipped by "
                             f"realloc; give yours another name")
        table[key] = i
    return MappingProxyType(table)


def default_impl(is_critic: bool) -> str:
    """What a call without ``interface_impl`` runs: PPO's actor or critic interface."""
    return "ppo_critic" if is_critic else "ppo_actor"


def lookup(table: Table, call: Any, is_critic: bool) -> Interface:
    """The interface a call runs, or one clear error naming the call."""
    name = call.interface_impl or default_impl(is_critic)
    found = table.get((name, call.interface_type))
    if found is not None:
        return found
    types = sorted(t.name for (n, t) in table if n == name)
    if not types:
        known = ", ".join(sorted({n for n, _ in table}))
        raise ValueError(f"call {call.name!r}: unknown interface_impl {name!r}; known: {known} (or declare it in the "
                         f"experiment's `interfaces`)")
    raise ValueError(f"call {call.name!r}: interface_impl {name!r} does not implement {call.interface_type.name}; it "
                     f"implements {', '.join(types)}")


def resolve_minibatches(spec: "ExperimentSpec") -> tuple[Any, ...]:
    """The calls of ``spec``, each TRAIN_STEP with the ``n_minibatches`` of its interface's settings.

    The settings are the one source of a train call's optimizer steps: ``grpo: GRPOConfig(n_minibatches=4)``
    (or ``--set grpo.n_minibatches=4``) gives it four. A call may repeat the number; a different one is an
    error, since one of the two would be silently ignored. An experiment without that settings field runs
    the call's own number, else the settings type's default.
    """
    table = interfaces_of(spec)
    out = []
    for r in spec.rpcs:
        if not r.is_train:
            out.append(r)
            continue
        # A call without interface_impl runs ppo_actor or ppo_critic (by its model's head, not known yet); both
        # read the `ppo` settings, so either answers the question.
        i = lookup(table, r, is_critic=False)
        settings = i.settings(spec.config)
        if getattr(spec.config, i.config or "", None) is None:
            n = r.n_minibatches if r.n_minibatches is not None else settings.n_minibatches
        else:
            n = settings.n_minibatches
            if r.n_minibatches is not None and r.n_minibatches != n:
                raise ValueError(
                    f"call {r.name!r}: n_minibatches={r.n_minibatches}, but the experiment's {i.config}."
                    f"n_minibatches is {n} (interface {i.name!r} takes its optimizer steps from its settings); give "
                    f"the number once, as {type(settings).__name__}(n_minibatches=...) in field {i.config!r} (or "
                    f"--set {i.config}.n_minibatches=N), and leave it out of the call")
        out.append(r if r.n_minibatches == n else dataclasses.replace(r, n_minibatches=n))
    return tuple(out)
