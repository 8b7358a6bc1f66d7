"""The ``interface_args`` of a multi-turn GENERATE call, checked torch-free (``realloc show`` runs the check)::

    interface_args={"env": "tools", "env_args": {"tools": ["calculator"]}, "max_turns": 4, "turn_tokens": 32}

- ``env``: ``"tools"`` (``tool_env.ToolEnv``), or a factory ``"module:function"`` / a function of the experiment
  file, called as ``env(**env_args)`` once per rollout;
- ``max_turns``: the most policy turns of a rollout (default 4);
- ``turn_tokens``: the most tokens of one policy turn (default: the rollout's whole budget, ``gen_len``);
- ``env_workers``: rollouts whose ``step`` runs at once on a replica's environment rank (default 4; tools are
  processes, so threads that wait on them are cheap);
- ``kv_cache``: keep each rollout's KV cache across its turns, so a turn prefills only the tokens appended since
  the last one (default True; False prefills the whole conversation every turn, ``models/turn_cache.py``);
- ``turn_profile``: what the planner prices (``envs/turn_profile.py``): the policy's tokens per turn, observation
  tokens, the share of rollouts that take each turn, seconds per tool step; default: the most a rollout may take.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from realloc.envs.turn_profile import TurnProfile, declared_profile, default_profile

KNOWN = ("env", "env_args", "max_turns", "turn_tokens", "env_workers", "turn_profile", "kv_cache")
# Interface.check_args of every multi-turn GENERATE interface: how the planner recognizes one (turn_profile.py)
ROLLOUT_CHECK = "realloc.envs.rollout_args:check"


@dataclasses.dataclass(frozen=True)
class RolloutArgs:
    env: Any
    env_args: Mapping[str, Any]
    max_turns: int = 4
    turn_tokens: int | None = None
    env_workers: int = 4
    turn_profile: Any = None  # None, a dict of turn_profile.PROFILE_KEYS or a TurnProfile
    kv_cache: bool = True


def _positive(call: str, name: str, v: Any, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"call {call!r}: interface_args[{name!r}] must be a positive integer, got {v!r}")


def rollout_args(call: str, args: Mapping[str, Any]) -> RolloutArgs:
    """The checked arguments, or one ValueError naming the call and the key."""
    if not isinstance(args, Mapping):
        raise ValueError(f"call {call!r}: interface_args must be a dict")
    unknown = sorted(set(args) - set(KNOWN))
    if unknown:
        raise ValueError(f"call {call!r}: unknown interface_args {', '.join(map(repr, unknown))} of a multi-turn "
                         f"rollout; known: {', '.join(KNOWN)}")
    env = args.get("env")
    if not (env == "tools" or callable(env) or (isinstance(env, str) and ":" in env)):
        raise ValueError(f"call {call!r}: interface_args['env'] must be 'tools' or an environment factory "
                         f"('module:function' or a function of the experiment file), got {env!r}")
    env_args = args.get("env_args", {})
    if not isinstance(env_args, Mapping):
        raise ValueError(f"call {call!r}: interface_args['env_args'] must be a dict of the factory's keywords")
    out = RolloutArgs(env, dict(env_args), args.get("max_turns", 4), args.get("turn_tokens"),
                      args.get("env_workers", 4), args.get("turn_profile"), args.get("kv_cache", True))
    if not isinstance(out.kv_cache, bool):
        raise ValueError(f"call {call!r}: interface_args['kv_cache'] must be True or False, got {out.kv_cache!r}")
    _positive(call, "max_turns", out.max_turns)
    _positive(call, "turn_tokens", out.turn_tokens, none_ok=True)
    _positive(call, "env_workers", out.env_workers)
    return out


def check(call: str, args: Mapping[str, Any]) -> None:
    out = rollout_args(call, args)
    if out.env == "tools":  # the built-in environment's arguments, before any worker makes one
        from realloc.envs.tool_env import check_env_args

        check_env_args(call, out.env_args)
    if out.turn_profile is not None:
        declared_profile(call, out.turn_profile, out.max_turns)


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    """A multi-turn GENERATE call as the estimator sees it: its profile, the turn cap and the environment threads."""

    profile: TurnProfile
    turn_tokens: int  # the most tokens of one policy turn (interface_args' turn_tokens, at most gen_len)
    env_workers: int
    kv_cache: bool = True  # later turns prefill only what was appended (interface_args' kv_cache)


def rollout_shape(call: str, interface: Any, args: Mapping[str, Any], gen_len: int) -> RolloutShape | None:
    """The shape of ``call`` when its interface is a multi-turn rollout (its ``check_args`` is the rollout
    arguments' check), else None. A measured profile comes in as ``args["turn_profile"]`` (``with_profile``)."""
    if not is_multiturn(interface):
        return None
    a = rollout_args(call, args)
    if a.turn_profile is not None:
        profile = declared_profile(call, a.turn_profile, a.max_turns)
    else:
        profile = default_profile(a.max_turns)
    return RolloutShape(profile, min(a.turn_tokens or gen_len, gen_len), a.env_workers, a.kv_cache)


def is_multiturn(interface: Any) -> bool:
    """Whether an ``Interface`` is a multi-turn GENERATE (its ``check_args`` is the rollout arguments' check)."""
    return getattr(interface, "check_args", None) == ROLLOUT_CHECK

