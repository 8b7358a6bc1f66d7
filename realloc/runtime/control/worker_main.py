"""A model worker process's entry point: ``python -m realloc.runtime.control.worker_main ARGS`` (the launchers').

A worker's start-up creates some 350,000 objects that live as long as it does (torch, megatron-core, its models),
and Python's cyclic collector scans all of them again each time enough new ones have arrived: six full
collections per worker during the demo's start-up, a fifth of its import time (docs/speed.md). The worker
therefore imports and sets up with the collector off, then moves everything it has to the collector's permanent
generation and turns it on (``records/startup.py``, ``settle_heap``, after its setup); every collection after
that scans only what the iterations create. Nothing it computes depends on when garbage is collected.
"""

from __future__ import annotations

import gc
import sys


def run() -> int:
    gc.disable()  # until the worker's setup is done (settle_heap)
    from realloc.runtime.control.worker import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
