"""The environment contract of multi-turn rollouts (``realloc/algorithms/multiturn.py`` drives it).

An environment is one object per rollout with two methods::

    class MyEnv:
        def reset(self, record: dict) -> str:
            '''The first observation, appended after the prompt ("" for none); ``record`` is the prompt's
            dataset record with all its other fields (``{"answer": "5535", ...}``).'''
        def step(self, text: str) -> tuple[str | None, float, bool]:
            '''The policy's turn (decoded text) in; (the next observation or None, this turn's reward, done) out.'''

and is made by a factory named in the GENERATE call's ``interface_args``: ``{"env": "my_envs:make_env",
"env_args": {...}}`` calls ``make_env(**env_args)`` once per rollout (``"tools"`` is the built-in ``ToolEnv``).

The rollout: prompt, first observation, then turns of policy tokens (sampled until EOS or the turn's token cap)
and observation tokens, until ``step`` says done, returns no observation, the turn limit (``max_turns``) is reached
or the rollout's token budget (the call's ``gen_len``, observations included) is spent; an observation that
does not fit is cut at the budget, and a turn cut by the budget still goes to ``step`` for its reward. The
rollout's score is the sum of its turns' rewards: a final-answer reward is a reward on the last turn only,
per-turn rewards add up. Environments run on one rank of each model replica (tensor- and pipeline-parallel
ranks get the observations from it), so they may be stateful and slow (tools) but must not rely on the rank.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from realloc.envs.resolve import resolve_function


class Environment(Protocol):
    def reset(self, record: Mapping[str, Any]) -> str: ...

    def step(self, text: str) -> tuple[str | None, float, bool]: ...


EnvFactory = Callable[..., Environment]


def env_factory(where: str, spec: Any) -> EnvFactory:
    """The factory an ``interface_args["env"]`` names: ``"tools"`` (``ToolEnv``), a function or "module:function"."""
    if spec == "tools":
        from realloc.envs.tool_env import ToolEnv

        return ToolEnv
    return resolve_function(where, spec, "interface_args['env']")


def check_env(where: str, spec: Any, env: Any) -> Environment:
    """What the factory made: an object with ``reset`` and ``step``, or one ValueError naming the factory (not an
    AttributeError from inside the rollout)."""
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
        raise ValueError(f"{where}: interface_args['env'] {name!r} made a {type(env).__name__}, which has no "
                         f"{' and no '.join(f'{m}()' for m in missing)}; an environment has reset(record) -> str and "
                         f"step(text) -> (observation or None, reward, done) (docs/multi-turn.md)")
    return env


def check_step(where: str, got: Any) -> tuple[str | None, float, bool]:
    """``step``'s answer, checked: one ValueError naming the environment otherwise."""
    if not (isinstance(got, tuple) and len(got) == 3):
        raise ValueError(f"{where}: step() must return (observation or None, reward, done), got {got!r}")
    obs, reward, done = got
    if obs is not None:
        check_text(where, "step()'s observation", obs)
    try:
        if isinstance(reward, (str, bytes)):  # float("1") would take it: a reward in the wrong field, likely
            raise TypeError
        r = float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: step()'s reward must be a number, got {reward!r}") from None
    if r != r or r in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: step()'s reward must be finite, got {r}")
    if done is None or isinstance(done, (str, bytes)):  # bool("False") is True: a done that means nothing here
        raise ValueError(f"{where}: step()'s done must be True or False, got {done!r}")
    return obs, r, bool(done)


def check_text(where: str, what: str, text: Any) -> str:
    """An observation: a str that UTF-8 can encode (a lone surrogate, as ``bytes.decode(errors="surrogateescape")``
    leaves, cannot be tokenized nor sent to the replica's other ranks), or one ValueError naming ``where``."""
    if not isinstance(text, str):
        raise ValueError(f"{where}: {what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: {what} is not valid text: {e.reason} at position {e.start} "
                         f"({text[e.start:e.start + 1]!r}); decode bytes with errors='replace'") from None
    return text
