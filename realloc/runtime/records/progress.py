"""What a run is doing inside an iteration, and when it will end: the console's progress (issue 22 item 15).

The master reports each node of the schedule (a call, a reallocation, a save, an evaluation) as it starts and
ends (``Master.on_node``). On a terminal the progress bar's status names the nodes running now and for how long,
and the ETA. Without one (a SLURM log, a pipe), the console gets plain lines only: one per iteration (with the
ETA), one when a node has run ``long_call`` seconds and every ``long_call`` seconds after that while it runs,
and one when such a long node ends; so a log shows where a slow run is, with no control characters.

ETA: the iterations left times the mean time of the iterations finished in this process after its first (the
first includes the first reallocations and warm-up); after only one, that one's time, counted from when the workers
were ready (``workers_ready``), so that starting them (seconds to minutes: importing torch, loading checkpoints) is
not taken for an iteration's time. Until they are ready the status says so instead of ``ETA ?``.
"""

from __future__ import annotations

import time
from typing import Callable

LONG_CALL_S = 60.0  # a node running this long gets a line of its own in plain output, and again every as long


def duration(seconds: float) -> str:
    """``42 s``, ``3m05s``, ``2h07m``: short and at a precision a person reads."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RunProgress:
    """Nodes running now and iteration end times, for the status text, the ETA and the long-node lines."""

    def __init__(self, total: int, start: int, long_call: float = LONG_CALL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total  # the run's last iteration (counted from 1)
        self.start = start  # iterations done before this process (a resumed run's checkpoint)
        self.long_call = long_call
        self.clock = clock
        self.began = clock()
        self.running: dict[tuple[str, int], float] = {}  # (node label, iteration from 1) -> start time
        self.reported: dict[tuple[str, int], float] = {}  # long nodes: when their last line was printed
        self.ends: list[float] = []  # end time of each iteration finished in this process
        self.ready: float | None = None  # when the workers had loaded and the iterations began

    # -- events ---------------------------------------------------------------------------------------------
    def node(self, label: str, iteration: int, seconds: float | None) -> str | None:
        """A node of ``iteration`` (from 1) started (``seconds`` None) or ended after ``seconds``. Returns the
        plain line for a long node that ended, else None."""
        key = (label, iteration)
        if seconds is None:
            self.running[key] = self.clock()
            return None
        self.running.pop(key, None)
        was_reported = self.reported.pop(key, None) is not None
        if was_reported or seconds >= self.long_call:
            return f"iter {iteration}/{self.total} | {label} done in {duration(seconds)}"
        return None

    def workers_ready(self) -> str:
        """The workers are set up (models loaded): the iterations begin. Returns the plain line saying so."""
        self.ready = self.clock()
        return f"workers ready after {duration(self.ready - self.began)}; training"

    def iteration_done(self) -> None:
        self.ends.append(self.clock())

    # -- what to show ---------------------------------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds until the last iteration ends; None before any iteration has."""
        done = len(self.ends)
        if not done:
            return None
        left = self.total - self.start - done
        if done == 1:
            per = self.ends[0] - (self.began if self.ready is None else self.ready)
        else:
            per = (self.ends[-1] - self.ends[0]) / (done - 1)
        return max(0.0, left * per)

    def eta_text(self) -> str:
        eta = self.eta()
        return "ETA ?" if eta is None else f"ETA {duration(eta)}"

    def status(self) -> str:
        """``iteration 3: actor_gen 12 s, ref_inf 2 s | ETA 4m10s``: the oldest iteration's running nodes."""
        now = self.clock()
        if self.ready is None and not self.ends and not self.running:
            return f"starting workers: importing, loading models and data ({duration(now - self.began)})"
        if not self.running:
            return self.eta_text()
        first = min(t for _, t in self.running)
        nodes = sorted(((since, label) for (label, t), since in self.running.items() if t == first))
        busy = ", ".join(f"{label} {duration(now - since)}" for since, label in nodes)
        return f"iteration {first}: {busy} | {self.eta_text()}"

    def long_lines(self) -> list[str]:
        """Plain lines for the nodes that have run ``long_call`` seconds since they started or were last
        reported (called every few seconds while the run goes on)."""
        now = self.clock()
        out = []
        for (label, t), since in sorted(self.running.items(), key=lambda kv: kv[1]):
            last = self.reported.get((label, t), since)
            if now - last >= self.long_call:
                self.reported[label, t] = now
                out.append(f"iter {t}/{self.total} | {label} running for {duration(now - since)}")
        return out
