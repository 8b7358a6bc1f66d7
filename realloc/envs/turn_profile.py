"""What a multi-turn rollout looks like to the planner: its turns, their lengths and the environment's time.

The estimator prices a multi-turn GENERATE call (``estimator/multiturn_cost.py``) from a ``TurnProfile``:

- ``policy[k]``: how many tokens the policy writes in turn k (a ``ResponseLengths``, so a turn's micro-batch ends
  with its longest row, as a single-turn generation does);
- ``observations[k]``: the mean tokens of the observation that follows turn k, for rollouts that go on;
- ``reach[k]``: the share of rollouts that take turn k (1 for the first);
- ``first_observation``: the mean tokens of the observation after the prompt;
- ``step_s``: seconds of one environment step that answers with an observation (a tool call), and ``final_s``
  of one that ends the rollout (scoring the answer);
- ``tool_processes``: how many tool processes ran at once on the host when ``step_s`` was measured (0: none
  other, ``step_s`` is a lone tool call's time; None: unknown, no contention is priced); the estimator prices
  contention for the host's cores from it (``estimator/multiturn_cost.py``: ``tool_slowdown``).

Three sources, in this order:

1. **measured**: ``realloc search --lengths-from RUN_DIR`` reads an earlier run's ``samples.jsonl`` (each logged
   multi-turn rollout's ``turn_segments``) and ``metrics.jsonl`` (the GENERATE call's ``env_obs_s`` /
   ``env_obs_steps`` and ``env_final_s`` / ``env_final_steps``): ``turns_from_run``;
2. **declared** in the call's ``interface_args["turn_profile"]``::

       {"policy_tokens": [12, 6], "observation_tokens": [9], "reach": [1.0, 0.9], "step_s": 0.08}

3. **default**: the most a rollout may take, ``max_turns`` turns of ``turn_tokens`` each within ``gen_len``, no
   observation tokens and no environment time.

Torch-free: ``realloc show`` and the search read it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from realloc.lengths import SAMPLES_FILE, ResponseLengths, run_records

PROFILE_KEYS = ("policy_tokens", "observation_tokens", "reach", "first_observation_tokens", "step_s", "final_s",
                "tool_processes")
METRICS_FILE = "metrics.jsonl"  # runtime/records/run_paths.py's name (not imported: the runtime sits above)
SEGMENTS = "turn_segments"  # the samples.jsonl field (runtime/records/text_io.py)


@dataclasses.dataclass(frozen=True)
class TurnProfile:
    policy: tuple[ResponseLengths, ...]
    observations: tuple[float, ...] = ()
    reach: tuple[float, ...] = ()
    first_observation: float = 0.0
    step_s: float = 0.0
    final_s: float = 0.0
    source: str = "declared"
    tool_processes: float | None = 0.0  # tool processes at once when step_s was measured (0: alone; None: unknown)

    def __post_init__(self) -> None:
        k = len(self.policy)
        if k < 1:
            raise ValueError("turn_profile: at least one turn")
        obs = tuple(self.observations) + (0.0,) * (k - len(self.observations))
        reach = tuple(self.reach) + (1.0,) * (k - len(self.reach)) if self.reach else (1.0,) * k
        object.__setattr__(self, "observations", obs[:k])
        object.__setattr__(self, "reach", reach[:k])

    @property
    def turns(self) -> int:
        return len(self.policy)

    def goes_on(self, k: int) -> float:
        """The share of turn k's rollouts that take turn k + 1 (their step answered with an observation)."""
        if k + 1 >= self.turns or self.reach[k] <= 0:
            return 0.0
        return min(1.0, self.reach[k + 1] / self.reach[k])

    def describe(self, cap: int) -> str:
        turns = ", ".join(f"{self.policy[k].mean(cap):.1f}" + (f" (x{self.reach[k]:.2f})" if self.reach[k] < 1 else "")
                          for k in range(self.turns))
        obs = ", ".join(f"{o:.1f}" for o in self.observations[:-1]) or "none"
        return (f"{self.turns} turns of {turns} policy tokens, observations {obs} tokens, "
                f"{self.step_s * 1e3:.0f} ms per tool step ({self.source})")


def _number(call: str, key: str, v: Any, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
        raise ValueError(f"call {call!r}: interface_args['turn_profile'][{key!r}] must be a number >= {low:g}, "
                         f"got {v!r}")
    return float(v)


def _numbers(call: str, key: str, v: Any, low: float = 0.0) -> tuple[float, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise ValueError(f"call {call!r}: interface_args['turn_profile'][{key!r}] must be a list of numbers, one per "
                         f"turn, got {v!r}")
    return tuple(_number(call, key, x, low) for x in v)


def declared_profile(call: str, spec: Any, max_turns: int) -> TurnProfile:
    """A ``TurnProfile`` given as itself or as the dict of ``PROFILE_KEYS``; one ValueError naming the key."""
    if isinstance(spec, TurnProfile):
        profile = spec
    else:
        if not isinstance(spec, Mapping):
            raise ValueError(f"call {call!r}: interface_args['turn_profile'] must be a dict with keys "
                             f"{', '.join(PROFILE_KEYS)}")
        unknown = sorted(set(spec) - set(PROFILE_KEYS))
        if unknown or "policy_tokens" not in spec:
            raise ValueError(f"call {call!r}: interface_args['turn_profile'] needs 'policy_tokens' (a list: the "
                             f"policy's tokens in each turn) and knows {', '.join(PROFILE_KEYS)}"
                             + (f"; unknown: {', '.join(map(repr, unknown))}" if unknown else ""))
        tokens = _numbers(call, "policy_tokens", spec["policy_tokens"], 1.0)
        if not tokens:
            raise ValueError(f"call {call!r}: interface_args['turn_profile']['policy_tokens'] needs one entry per turn")
        reach = _numbers(call, "reach", spec.get("reach", ()))
        obs = _numbers(call, "observation_tokens", spec.get("observation_tokens", ()))
        for key, n in (("reach", len(reach)), ("observation_tokens", len(obs))):  # a longer list was cut silently
            if n > len(tokens):
                raise ValueError(f"call {call!r}: interface_args['turn_profile'][{key!r}] has {n} entries but "
                                 f"'policy_tokens' has {len(tokens)} turns; give at most one per turn")
        if reach and reach[0] != 1:
            raise ValueError(f"call {call!r}: interface_args['turn_profile']['reach'][0] must be 1 (every rollout "
                             f"takes the first turn), got {reach[0]!r}")
        if any(r > 1 for r in reach) or any(b > a for a, b in zip(reach, reach[1:])):
            raise ValueError(f"call {call!r}: interface_args['turn_profile']['reach'] must be shares of the rollouts "
                             f"(at most 1) that do not grow from turn to turn, got {list(reach)}")
        profile = TurnProfile(tuple(ResponseLengths.uniform(max(1, round(t)), max(1, round(t))) for t in tokens),
                              obs, reach,
                              _number(call, "first_observation_tokens", spec.get("first_observation_tokens", 0)),
                              _number(call, "step_s", spec.get("step_s", 0.0)),
                              _number(call, "final_s", spec.get("final_s", 0.0)), "declared",
                              _number(call, "tool_processes", spec.get("tool_processes", 0.0)))
    if profile.turns > max_turns:
        raise ValueError(f"call {call!r}: interface_args['turn_profile'] has {profile.turns} turns but max_turns is "
                         f"{max_turns}")
    return profile


def default_profile(max_turns: int) -> TurnProfile:
    """Every rollout takes ``max_turns`` turns of the whole turn cap (fixed lengths), within the budget."""
    return TurnProfile((ResponseLengths.fixed(),) * max_turns, source="default: max_turns x turn_tokens")


# -- measured: an earlier run's records --------------------------------------------------------------------------
def segments_of(policy_mask: Sequence[bool]) -> list[int]:
    """Lengths of the alternating runs of environment and policy tokens of one response, the environment's first
    (0 when the response opens with the policy's turn): what ``samples.jsonl`` records as ``turn_segments``."""
    out, current, n = [], False, 0
    for p in policy_mask:
        if bool(p) != current:
            out.append(n)
            current, n = bool(p), 0
        n += 1
    out.append(n)
    return out


def has_turns(run_dir: str | Path) -> bool:
    """Whether an earlier run logged multi-turn rollouts (``turn_segments`` in its samples)."""
    path = Path(run_dir) / SAMPLES_FILE
    return path.is_file() and any(SEGMENTS in r for r in run_records(path))


def turns_from_run(run_dir: str | Path, call: str | None = None) -> TurnProfile:
    """The turn profile of an earlier run's multi-turn rollouts: per-turn policy lengths (empirical), observation
    tokens and reach from ``samples.jsonl``'s ``turn_segments``, the environment's seconds per step from the
    GENERATE call's stats in ``metrics.jsonl`` (``call``, else every call that reports them)."""
    root = Path(run_dir)
    path = root / SAMPLES_FILE
    if not path.is_file():
        raise ValueError(f"--lengths-from {run_dir}: no {SAMPLES_FILE} in it; a run logs its samples there unless "
                         f"sample_every=0")
    rollouts = [r[SEGMENTS] for r in run_records(path) if isinstance(r.get(SEGMENTS), list) and r[SEGMENTS]]
    bad = next((s for s in rollouts if not all(_count(n) for n in s)), None)
    if bad is not None:  # a hand-edited or foreign file: one error, not a TypeError deep in the sums
        raise ValueError(f"--lengths-from {run_dir}: {path} has a {SEGMENTS} entry {str(bad)[:80]}; each must be a "
                         f"list of token counts (whole numbers >= 0), as a realloc run writes it")
    if not rollouts:
        raise ValueError(f"--lengths-from {run_dir}: {path} records no multi-turn rollout ({SEGMENTS})")
    policy: list[list[int]] = []
    obs: list[list[int]] = []
    first = []
    for seg in rollouts:
        first.append(seg[0])
        turns = seg[1::2]
        after = seg[2::2]
        for k, n in enumerate(turns):
            if n <= 0:
                continue
            while len(policy) <= k:
                policy.append([])
                obs.append([])
            policy[k].append(int(n))
            if k < len(after):
                obs[k].append(int(after[k]))
    sums = {"env_obs_s": 0.0, "env_obs_steps": 0.0, "env_final_s": 0.0, "env_final_steps": 0.0}
    metrics = root / METRICS_FILE
    if metrics.is_file():
        for rec in run_records(metrics):
            calls = rec.get("calls")
            for name, stats in (calls.items() if isinstance(calls, dict) else ()):
                if (call is None or name == call) and isinstance(stats, dict):
                    for k in sums:
                        v = stats.get(k, 0.0)
                        if not _count(v, whole=False):
                            raise ValueError(f"--lengths-from {run_dir}: {metrics} has {k}={str(v)[:40]} for call "
                                             f"{name!r}; it must be a number >= 0, as a realloc run writes it")
                        sums[k] += float(v)
    total = len(rollouts)
    return TurnProfile(tuple(ResponseLengths.empirical(p) for p in policy),
                       tuple(sum(o) / len(o) if o else 0.0 for o in obs), tuple(len(p) / total for p in policy),
                       sum(first) / total,
                       sums["env_obs_s"] / sums["env_obs_steps"] if sums["env_obs_steps"] else 0.0,
                       sums["env_final_s"] / sums["env_final_steps"] if sums["env_final_steps"] else 0.0,
                       f"measured: {total} rollouts of {root.name}")


def _count(v: Any, whole: bool = True) -> bool:
    """Whether ``v`` is a count (or, with ``whole=False``, any finite number) >= 0 as a run's records hold it."""
    kinds = (int,) if whole else (int, float)
    return isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def with_profile(spec: Any, calls: Sequence[str], profile: TurnProfile) -> Any:
    """``spec`` with ``profile`` as the ``turn_profile`` of its multi-turn GENERATE ``calls`` (``--lengths-from``)."""
    rpcs = tuple(dataclasses.replace(r, interface_args={**r.interface_args, "turn_profile": profile})
                 if r.name in calls else r for r in spec.rpcs)
    return dataclasses.replace(spec, rpcs=rpcs)
