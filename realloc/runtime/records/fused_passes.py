"""The passes of a fused train pair as they ran (docs/fused-training.md), for the run's timeline.

A worker that runs a fused pair's request (``control/worker_fused.py``) appends one line per request to
``fused_passes/worker<rank>.jsonl`` in the run directory: the request, its iteration (from 1) and every
forward and backward pass of both calls on this device, each from its input's arrival to its output's
posting. ``with_passes`` turns them into requests.jsonl-like rows, one per pass labelled with its call, which
the measured timeline draws over the pair's request (``realloc trace``): each device's row shows the two
models' passes interleaved as the schedule ran them, with the optimizer steps and the calls' own work
(inputs, mini-batches) between them in the request's colour.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

PASSES_DIR = "fused_passes"


def write_passes(run_dir: Path, rank: int, req: Any, passes: Sequence[Sequence[float]]) -> None:
    """Append one fused request's passes (step, model, backward, micro-batch, start, end) of this worker."""
    folder = Path(run_dir) / PASSES_DIR
    folder.mkdir(exist_ok=True)
    line = {"req": req.req, "iteration": req.iteration + 1, "calls": [req.call, req.fused_with],
            "passes": [list(p) for p in passes]}
    with open(folder / f"worker{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def with_passes(requests: list[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """``requests`` (requests.jsonl's rows) followed by a row per recorded pass of each fused request, in its
    session, so that ``join_sessions`` moves them with it."""
    folder = Path(run_dir) / PASSES_DIR
    if not folder.is_dir():
        return requests
    by_key = {(r["req"], r["iteration"]): r for r in requests if r.get("kind") == "call" and "+" in r["label"]}
    out = list(requests)
    for path in sorted(folder.glob("worker*.jsonl")):
        rank = path.stem[len("worker"):]
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue  # a line a killed worker left half-written
            if not isinstance(line, dict) or not isinstance(line.get("passes"), list):
                continue  # not a line a worker wrote (hand-edited): the timeline goes on without it
            fused = by_key.get((line.get("req"), line.get("iteration")))
            if fused is None:
                continue
            calls = line.get("calls")
            for p in line["passes"]:
                if not (isinstance(p, list) and len(p) == 6 and isinstance(calls, list) and len(calls) == 2
                        and all(isinstance(x, (int, float)) for x in p) and p[1] in (0, 1)):
                    continue
                _, model, backward, mb, start, end = p
                out.append({**fused, "label": calls[int(model)], "pass": "backward" if backward else "forward",
                            "micro_batch": int(mb), "spans": {rank: [start, end]}, "received": {}})
    return out
