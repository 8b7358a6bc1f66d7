"""Where ``realloc run`` spends the seconds before its first call (torch-free).

The master marks the end of each of its start-up phases; the workers report in their hello when their process
started, when their imports were done and when they had their arguments. ``StartupClock.report`` turns these into
the breakdown the run prints at its end and writes to ``startup.json`` (docs/speed.md):

    start-up 9.8 s to the first call: master imports 1.1 s, experiment and prompts 0.9 s, plan search 0.4 s,
    master ready 0.6 s, workers ready 5.9 s, setup 0.7 s, first reallocation 0.0 s;
    workers: started 1.2 s in, imports 4.9 s (slowest worker 1), waited 0.0 s for the master

Phases follow one another on the master's clock (they add up to the total); the workers' line says where in
them the workers were, since they start before the search and import while the master works (launcher.py).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import io
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, Sequence

# A worker started by LocalLauncher.prestart reads its arguments as one JSON line on stdin (worker.main).
ARGS_FROM_STDIN = "--args-from-stdin"

# The master's phases, in order, with the words the report uses.
PHASES = (
    ("imports", "master imports"),
    ("experiment", "experiment and prompts"),
    ("search", "plan search"),
    ("master", "master ready"),
    ("workers", "workers ready"),
    ("setup", "setup"),
    ("first_call", "first reallocation"),
)


def process_start_time(pid: int | str = "self") -> float | None:
    """When process ``pid`` started, in ``time.time()`` seconds (Linux's /proc); None where there is no /proc.

    The interpreter's own start (before any import) is part of start-up and no Python code runs that early."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


# What a worker's setup imports anyway: torch.optim's first optimizer imports torch._dynamo (0.3-0.6 CPU s). A worker
# started early imports it while it waits for its arguments, off the path to the first call. (transformers is no
# longer preloaded: a plain tokenizer directory loads without it, data/light_tokenizer.py.)
WORKER_PRELOAD = ("torch._dynamo",)


def settle_heap() -> None:
    """After a process's start-up, if its entry point turned the cyclic collector off for it
    (``control/worker_main.py``, ``cli.entry`` for ``realloc run``): what it has allocated so far (imports,
    models) stays for its whole life, so move it out of the collector's scans (``gc.freeze``) and turn the
    collector on. A process that collects as usual (a test calling ``main``, a Ray actor) is left alone."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _readable(stream: Any) -> bool:
    """Whether ``stream`` has input waiting (a pipe's); False where it cannot tell (no file descriptor)."""
    try:
        return bool(select.select([stream], [], [], 0)[0])
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


def worker_argv(argv: list[str], preload: Sequence[str] = ()) -> list[str] | None:
    """A worker's arguments: ``argv`` itself, or for a worker started early (``[ARGS_FROM_STDIN]``) the JSON list
    the launcher writes on its stdin; None when stdin closes first (the master stopped before the run started).
    A worker started early first imports the modules ``preload`` names (``WORKER_PRELOAD``), while its arguments
    have not arrived: once they are there, setup imports what is left itself, and the run waits for no preload."""
    if argv != [ARGS_FROM_STDIN]:
        return argv
    for name in preload:
        if _readable(sys.stdin):
            break
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional speed-up only
    line = sys.stdin.readline()
    return [str(a) for a in json.loads(line)] if line else None


@dataclasses.dataclass(frozen=True)
class WorkerStart:
    """A worker's own start-up times (``time.time()``), from its hello."""

    rank: int
    started: float  # the process started (0: unknown)
    imported: float  # its imports (torch, megatron) were done
    ready: float  # it had its arguments and connects to the master


@dataclasses.dataclass
class StartupClock:
    """The master's start-up marks: ``mark(phase)`` as each phase of ``PHASES`` ends (one clock per run)."""

    launched: float = dataclasses.field(default_factory=lambda: process_start_time() or time.time())
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    workers: dict[int, WorkerStart] = dataclasses.field(default_factory=dict)

    def mark(self, phase: str, at: float | None = None) -> None:
        """``phase`` ends now, or at ``at`` (time.time(): an event's own time, so that records of it agree)."""
        assert phase in dict(PHASES), phase
        # the first time counts (a first call is marked once)
        self.marks.setdefault(phase, time.time() if at is None else at)

    def report(self) -> dict[str, Any]:
        """Seconds per phase (phases not reached are left out), the total to the first call, and the workers'."""
        phases: dict[str, float] = {}
        last = self.launched
        for name, _ in PHASES:
            if name in self.marks:
                phases[name] = round(max(0.0, self.marks[name] - last), 3)
                last = max(last, self.marks[name])
        out: dict[str, Any] = {"launched": self.launched, "first_call": self.marks.get("first_call"),
                               "total_s": round(last - self.launched, 3), "phases_s": phases}
        known = [w for w in self.workers.values() if w.started > 0]
        if known:
            slow = max(known, key=lambda w: w.imported - w.started)
            out["workers"] = {"started_s": round(min(w.started for w in known) - self.launched, 3),
                              "imports_s": round(slow.imported - slow.started, 3), "slowest": slow.rank,
                              "waited_s": round(max(w.ready - w.imported for w in known), 3)}
        return out

    def line(self) -> str:
        r = self.report()
        words = dict(PHASES)
        parts = ", ".join(f"{words[k]} {v:.1f} s" for k, v in r["phases_s"].items())
        text = f"start-up {r['total_s']:.1f} s to the first call: {parts}"
        w = r.get("workers")
        if w:
            text += (f"; workers: started {w['started_s']:.1f} s in, imports {w['imports_s']:.1f} s (slowest worker "
                     f"{w['slowest']}), waited {w['waited_s']:.1f} s for the master")
        return text

    def write(self, path: Path) -> None:
        from realloc.runtime.records.run_paths import naming

        with naming(path):
            path.write_text(json.dumps(self.report(), indent=2) + "\n")
