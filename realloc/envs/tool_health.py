"""When the sandbox itself fails: a tool call the machine could not start (no space for its working folder, a
failed fork or exec, EAGAIN on the process limit) is an error observation counted as ``tool_infra``, and the
rollouts go on; but a machine where EVERY call fails so would train on error observations only, so the run stops.

The rule: ``INFRA_STREAK`` tool calls in a row of one GENERATE call (on a replica's reporting rank, counted turn by
turn over all its rollouts) that failed for infrastructure reasons stop the run in one line naming the cause; any
call that started (whatever the tool then did) resets the count. A passing shortage (a moment without a free
process slot) costs a few error observations; a full disk stops the run within its first turn or two.
"""

from __future__ import annotations

from typing import Any, Sequence

INFRA_STREAK = 8


class InfraWatch:
    """The streak of infrastructure failures over the turns of one call (``multiturn.TurnRollouts``)."""

    def __init__(self, limit: int = INFRA_STREAK) -> None:
        self.limit, self.streak = limit, 0

    @staticmethod
    def counts(envs: Sequence[Any]) -> tuple[int, int]:
        """(infrastructure failures, other tool calls that started) so far, over environments with ``tool_counts``
        (ToolEnv); a call answered without running (``ToolEnv.unstarted``: malformed, or past max_calls) is neither."""
        infra = other = 0
        for e in envs:
            other -= getattr(e, "unstarted", 0)
            for status, c in getattr(e, "tool_counts", {}).items():
                if status == "infra":
                    infra += c
                else:
                    other += c
        return infra, other

    def turn(self, where: str, envs: Sequence[Any], before: tuple[int, int]) -> None:
        """After a turn's steps: raise (one line, the last failure's text) once ``limit`` calls in a row failed so."""
        infra, other = self.counts(envs)
        failed, started = infra - before[0], other - before[1]
        self.streak = failed if started else self.streak + failed
        if self.streak >= self.limit:
            cause = next((e.infra_error for e in envs if getattr(e, "infra_error", "")), "unknown")
            raise RuntimeError(f"{where}: the last {self.streak} tool calls could not be started (the machine, not "
                               f"the tools: {cause.removeprefix('error: ')}); free disk space in the temp folder "
                               f"(TMPDIR) or raise the process limit, then run again")
