"""A bounded busy-wait for blocking collectives on CPU (gloo) tensors (issue 31; docs/estimator.md, "Waits at
dp > 1").

A rank that enters a blocking gloo collective before its peer sleeps in ``work.wait()`` and, on a loaded machine,
is slow to wake once the peer's data is in: an 8-byte all-reduce entered 1 ms late by one rank cost 0.4-3.0 ms
more at normal scheduling (0.15-0.23 ms under real-time priority). Here the caller issues the same collective
with ``async_op=True`` and polls ``work.is_completed()``, yielding the core between polls, for at most a short
bound; only then does it sleep in ``work.wait()``. The collective, its order and its result are the same as the
blocking call's: only how this thread waits for it changes.

CUDA (NCCL) tensors take the blocking call unchanged: there ``wait()`` does not block the host, and polling would.
The bound is ``REALLOC_COLLECTIVE_SPIN_MS`` (milliseconds, 0 turns the spin off), read at each call so a worker
takes it from the environment it was started with.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch-free at import: the master checks the setting before any worker starts (preflight.py)
    import torch

SPIN_ENV = "REALLOC_COLLECTIVE_SPIN_MS"
DEFAULT_SPIN_MS = 0.0


def spin_seconds() -> float:
    """The bound of the busy-wait, in seconds, from ``REALLOC_COLLECTIVE_SPIN_MS`` (default ``DEFAULT_SPIN_MS``)."""
    raw = os.environ.get(SPIN_ENV, "")
    if not raw.strip():
        return DEFAULT_SPIN_MS / 1e3
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{SPIN_ENV}={raw!r}: give the busy-wait bound in milliseconds, e.g. 3 (0 turns it off)")
    if not ms >= 0.0 or ms == float("inf"):
        raise ValueError(f"{SPIN_ENV}={raw!r}: give a finite number of milliseconds >= 0 (0 turns it off)")
    return ms / 1e3


def finish(work: Any, spin_s: float | None = None) -> bool:
    """Wait for ``work`` (an async collective on CPU tensors): poll it for up to ``spin_s`` seconds (default
    ``spin_seconds()``), then block in ``work.wait()``. Returns whether it completed within the spin."""
    bound = spin_seconds() if spin_s is None else spin_s
    if bound > 0.0:
        deadline = time.perf_counter() + bound
        while not work.is_completed():
            if time.perf_counter() >= deadline:
                break
            os.sched_yield()
    done = bool(work.is_completed())
    work.wait()  # returns at once when done; raises what the collective raised
    return done


def blocking(fn: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """``fn(tensor, *args, **kwargs)``, a ``torch.distributed`` collective whose first argument is ``tensor``,
    waited for as a blocking call would be: by the bounded busy-wait on a CPU tensor, else blocking as it was."""
    spin = spin_seconds()
    if spin <= 0.0 or tensor.device.type != "cpu":
        fn(tensor, *args, **kwargs)
        return
    finish(fn(tensor, *args, async_op=True, **kwargs), spin)
