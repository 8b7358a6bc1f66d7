"""Runs that end the way clusters end them: SIGTERM, and a warning signal ahead of the time limit.

SLURM sends SIGTERM to every process of a job when it is cancelled or reaches its time limit, and
SIGKILL ``KillWait`` seconds later (30 by default). Asked with ``#SBATCH --signal=B:USR1@120`` it
also sends USR1 to the batch script 120 s before the limit; the script passes it on to the master.

On either signal the master stops dispatching new iterations, lets the ones already running finish,
saves a checkpoint if its estimated duration fits in the time left, shuts the workers down and exits
with status 128 + the signal's number. Workers that receive SIGTERM keep going and report it with
their heartbeat, so the master decides for the whole run. Ctrl-C (SIGINT) still stops at once.

A call stuck in flight (a reward service that never answers, a collective that hangs) must not outlast
the grace: ``STOP_MARGIN`` s before the time left runs out, the master gives up waiting, kills the
workers, says that no new checkpoint was written and which one is the newest, and exits with the same
status, before SLURM's SIGKILL could leave processes behind.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from realloc.runtime.control.program import RuntimeProgram

# Seconds between SIGTERM and SIGKILL: SLURM's default KillWait (clusters may configure another value).
TERM_GRACE = 30.0
DEFAULT_WARNING = "USR1@120"
# Seconds before the time left runs out at which a stop still waiting for a call gives up: enough to kill the
# workers (master_link.KILL_GRACE) and close the run's records.
STOP_MARGIN = 3.0
# A checkpoint is saved only if this multiple of its estimated duration fits in the time left.
SAVE_SAFETY = 1.5
# Write rate assumed for a first checkpoint, before one has been measured (bytes/s per worker).
ASSUMED_SAVE_BANDWIDTH = 200e6

_UNUSABLE = {signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT}


@dataclasses.dataclass(frozen=True)
class StopSignals:
    """The signals that stop a run cleanly, each with the seconds left before the run is killed."""

    warning: signal.Signals = signal.SIGUSR1
    warning_lead: float = 120.0
    term_grace: float = TERM_GRACE  # SLURM's KillWait; shorter in tests

    @classmethod
    def parse(cls, text: str) -> "StopSignals":
        """``USR1@120`` (SLURM's ``--signal`` syntax, without ``B:``): the signal and its lead in seconds."""
        m = re.fullmatch(r"(?:SIG)?([A-Z0-9]+)@(\d+)", text.strip().upper())
        name = f"SIG{m.group(1)}" if m else ""
        if not m or not hasattr(signal.Signals, name):
            raise ValueError(f"--warning-signal {text!r}: expected SIGNAL@SECONDS, e.g. {DEFAULT_WARNING}")
        sig = signal.Signals[name]
        if sig in _UNUSABLE:
            raise ValueError(f"--warning-signal {text!r}: {name} cannot be the warning signal; use USR1 or USR2")
        if int(m.group(2)) < 1:
            raise ValueError(f"--warning-signal {text!r}: the lead time must be at least 1 second")
        return cls(sig, float(m.group(2)))

    def __str__(self) -> str:
        return f"{self.warning.name.removeprefix('SIG')}@{self.warning_lead:.0f}"

    @property
    def time_left(self) -> dict[signal.Signals, float]:
        """Seconds the run has left after each stop signal arrives."""
        return {signal.SIGTERM: self.term_grace, self.warning: self.warning_lead}

    def sbatch_directive(self) -> str:
        """Ask SLURM to send the warning signal to the batch script (``B:``) ahead of the time limit."""
        return f"#SBATCH --signal=B:{self}"

    def catch(self, on_signal: Callable[[int], None]) -> Callable[[], None]:
        """Call ``on_signal(signum)`` for each stop signal; returns a function restoring the old handlers.

        ``on_signal`` runs in the signal handler: it should only schedule work (``call_soon_threadsafe``).
        """
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # handlers can be set in the main thread only
        previous = {sig: signal.signal(sig, lambda s, _: on_signal(s)) for sig in self.time_left}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return restore


@dataclasses.dataclass
class StopRequest:
    """A stop signal the master received, and how the stop ended."""

    signal: signal.Signals
    source: str  # "master" or "worker <r>"
    deadline: float  # time.monotonic() by which the run will be killed
    after_iteration: int = 0  # iterations finished (counted from 1) when the run stopped
    checkpoint: str | None = None
    note: str = ""  # why no checkpoint was saved

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)

    def describe(self, resume_hint: str) -> str:
        what = f"stopped by {self.signal.name}" + ("" if self.source == "master" else f" (received by {self.source})")
        if self.after_iteration:
            what += f" after iteration {self.after_iteration}"
        if self.checkpoint:
            return f"{what}; saved {self.checkpoint}; continue with --resume {resume_hint}"
        return f"{what}; {self.note or 'no checkpoint saved'}"


def checkpoint_seconds(program: "RuntimeProgram", n_workers: int, measured: float | None) -> float:
    """How long a checkpoint takes: the longest one measured in this run, else what the busiest worker
    writes (its trained models' home shards with AdamW state) at ``ASSUMED_SAVE_BANDWIDTH``."""
    if measured is not None:
        return measured
    # Two fp32 moments per parameter, plus fp32 master weights for 16-bit parameters.
    per_param = program.bytes_per_param + 8 + (4 if program.bytes_per_param < 4 else 0)
    per_rank = [0.0] * n_workers
    for m in program.models:
        if program.is_trained(m):
            cl = program.calls[program.home_call(m)]
            shard = program.model_config(m).allocated_params * per_param / (cl.strategy.tp * cl.strategy.pp)
            for r in cl.ranks:
                per_rank[r] += shard
    return max(per_rank) / ASSUMED_SAVE_BANDWIDTH
