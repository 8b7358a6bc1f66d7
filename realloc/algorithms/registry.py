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
        return CallResult({"rewards": {"score": score}}, {}, {})   # the reward stats are made for you

    interfaces = [Interface("length_reward", INFERENCE, length_reward, inputs=("seq",),
                            outputs=("rewards",), head="none")]
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Protocol

from realloc.algorithms.builtin import BUILTIN
from realloc.algorithms.interface import HEADS, Interface, Slot
from realloc.calls import InterfaceType, ModelFunctionCallDef

__all__ = ["HEADS", "Interface", "Slot", "Table", "builtin_interfaces", "default_impl", "interfaces_of", "lookup",
           "resolve_minibatches"]


class Experiment(Protocol):
    """What the registry reads of an experiment (``api.ExperimentSpec``; the API imports the registry)."""

    name: str
    config: Any
    rpcs: tuple[ModelFunctionCallDef, ...]


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
    return MappingProxyType(_table(BUILTIN, "realloc.algorithms.builtin"))


def interfaces_of(spec: Experiment) -> Table:
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


def lookup(table: Table, call: ModelFunctionCallDef, is_critic: bool) -> Interface:
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


def resolve_minibatches(spec: Experiment) -> tuple[ModelFunctionCallDef, ...]:
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
