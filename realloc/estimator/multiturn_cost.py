"""Time of a multi-turn GENERATE call (issue 34, item 4): its turns priced one by one.

The call (``algorithms/critic_free/multiturn.py``) runs, per turn, one ``generate`` over the rollouts still going,
with their conversation so far as the prompt, then the environment's steps on the replica's reporting rank,
``env_workers`` at a time. Per dp rank of ``n`` rollouts, turn k of the profile (``envs/turn_profile.py``) is:

- ``rows = reach[k] * n`` rollouts, in ``min(n_mbs, rows)`` micro-batches of ``b`` rows;
- a generation (``CallTimer.generate_varied``) whose prompt is the prompt plus the longest conversation so far
  (first observation, then each earlier turn's longest policy turn and its observation: rows are padded to the
  micro-batch's longest); with the KV cache kept across turns (``kv_cache``, the default) a later turn prefills
  only what was appended, the last sampled token and the observation (``models/turn_cache.py``), plus that
  prefill's attention over the kept keys (``kept_prefill.py``); its rows stop at the expected order statistics of
  the turn's policy lengths,
  capped at ``turn_tokens`` and the budget left (``gen_len`` less the mean conversation so far);
- the environment: ``ceil(rows / env_workers)`` rounds of steps, each ``step_s`` for a step that answers with an
  observation (a tool call) and ``final_s`` for one that ends the rollout, in the share the profile's reach says.

Tool time is host time (``CallCost.overhead``). The call's own dispatch overhead is added once.

**Contention for the host's cores** (issue 34; measured on the 2-core machine: a tool step 205 ms with 8 tool
processes at once against 127 ms with 4). A sandboxed tool call is a fresh process that needs a core; with more
tool processes at once than the host has cores, each waits its turn. So a tool step costs

    step_s / max(1, c0 / cores) x max(1, c / cores)            (``tool_slowdown``)

with c0 the processes at once when ``step_s`` was measured (the profile's ``tool_processes``: from a run's plan, 0
for a lone call, unknown: no contention priced) and c = the call's replicas on one host x min(env_workers, the turn's rollouts per replica):
every environment thread of every replica on the host counts as a tool process. ``cores`` is the host's
(``cores_per_device`` x devices per node); a host with more cores than tool processes prices no contention.
"""

from __future__ import annotations

import dataclasses
import math

from realloc.envs.rollout_args import RolloutShape
from realloc.estimator.call_time import ZERO, CallCost, CallTimer
from realloc.estimator.comm import GroupLinks
from realloc.estimator.memory import Workload
from realloc.strategy import ParallelStrategy


@dataclasses.dataclass(frozen=True)
class ToolHost:
    """Where a multi-turn call's tools run: how many of its dp replicas share one host, and that host's cores."""

    replicas: int = 1
    cores: float = math.inf


def tool_slowdown(processes: float, measured_at: float | None, cores: float) -> float:
    """How much slower a tool step is with ``processes`` tool processes at once on ``cores`` cores than the profile's
    step, measured with ``measured_at`` at once: max(1, c / cores) / max(1, c0 / cores) (1 when c0 is unknown)."""
    if measured_at is None:
        return 1.0
    return max(1.0, processes / cores) / max(1.0, measured_at / cores)


@dataclasses.dataclass(frozen=True)
class TurnCost:
    turn: int  # counted from 1
    rows: int  # rollouts of one dp rank that take the turn
    prompt: int  # the turn's prompt: the prompt and the longest conversation so far
    tokens: int  # the longest policy turn of a micro-batch
    generate: CallCost
    env_s: float  # the environment's steps of the turn

    @property
    def time(self) -> float:
        return self.generate.time + self.env_s


def turn_costs(timer: CallTimer, work: Workload, shape: RolloutShape, strategy: ParallelStrategy,
               links: GroupLinks, n_mbs: int, host: ToolHost = ToolHost()) -> list[TurnCost]:
    """Each turn's generation and environment time on one dp rank (the module docstring's formulas)."""
    prof = shape.profile
    n = work.micro_batch(strategy.dp, 1)  # rollouts of one dp rank
    P, T = work.prompt_len, work.gen_len
    mean_ctx = longest_ctx = prof.first_observation
    out = []
    for k in range(prof.turns):
        left = T - mean_ctx
        rows = round(prof.reach[k] * n)
        if left < 1 or rows < 1:
            break
        mbs = min(n_mbs, rows)
        b = math.ceil(rows / mbs)
        cap = max(1, min(shape.turn_tokens, int(left)))
        ends = prof.policy[k].order_statistics(cap, b)
        prompt = P + math.ceil(min(longest_ctx, T))
        # kept keys: turn k prefills the previous turn's last sampled token and its observation
        appended = None if k == 0 or not shape.kv_cache else min(prompt, 1 + math.ceil(prof.observations[k - 1]))
        gen = timer.generate_varied(strategy, links, b, prompt, ends, mbs, appended)
        on = prof.goes_on(k)
        slow = tool_slowdown(host.replicas * min(shape.env_workers, rows), prof.tool_processes, host.cores)
        env = math.ceil(rows / shape.env_workers) * (on * prof.step_s * slow + (1 - on) * prof.final_s)
        out.append(TurnCost(k + 1, rows, prompt, ends[-1], gen, env))
        mean_ctx += prof.policy[k].mean(cap) + prof.observations[k]
        longest_ctx += ends[-1] + prof.observations[k]
    return out


def multiturn_time(timer: CallTimer, work: Workload, shape: RolloutShape, strategy: ParallelStrategy,
                   links: GroupLinks, n_mbs: int, host: ToolHost = ToolHost()) -> CallCost:
    """The whole call: its turns, their environment steps and one dispatch."""
    total = CallCost.of(overhead=timer.hw.call_overhead)
    for t in turn_costs(timer, work, shape, strategy, links, n_mbs, host):
        total = total + t.generate + CallCost.of(overhead=t.env_s)
    return total if total.time else ZERO
