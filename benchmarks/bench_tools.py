"""What a contained tool call costs: the calculator in this process against the same call in the sandbox
(realloc/tools/sandbox.py: a fresh ``python -I`` per call), with each network isolation this machine offers.

The columns are the median and the 90th percentile of the wall time per call over ``--calls`` calls in a row,
and the ratio of each median to the in-process call. A multi-turn rollout pays this once per tool call, on the
replica's reporting rank, ``env_workers`` calls at a time.

    .venv/bin/python benchmarks/bench_tools.py --calls 40
"""

from __future__ import annotations

import argparse
import statistics
import time

from realloc.tools.builtin import calculate
from realloc.tools.sandbox import Sandbox, ToolLimits, network_isolation


def _times(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    rows = [("in process", _times(lambda: calculate("123*45"), args.calls))]
    kinds = ["socket_block"] + (["namespace"] if network_isolation() == "namespace" else [])
    for kind in kinds:
        box = Sandbox(ToolLimits(), kind)  # type: ignore[arg-type]
        rows.append((f"sandbox, {kind}", _times(lambda: box.run("realloc.tools.builtin:calculator", "123*45"),
                                                args.calls)))
    base = statistics.median(rows[0][1])
    print(f"{'calculator call':<24}{'median ms':>12}{'p90 ms':>10}{'x in process':>14}")
    for name, ts in rows:
        med, p90 = statistics.median(ts), sorted(ts)[int(0.9 * (len(ts) - 1))]
        print(f"{name:<24}{med * 1e3:>12.2f}{p90 * 1e3:>10.2f}{med / base:>14.0f}")


if __name__ == "__main__":
    main()
