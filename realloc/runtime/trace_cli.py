"""``realloc trace RUN_DIR --timeline out.svg|png|html``: draw what a run did, with the estimate beside it.

    realloc trace runs/demo --timeline demo.png                 # iterations 1..3, measured over estimated
    realloc trace runs/demo --timeline demo.html --iterations 5..8

The measured panel comes from the run's requests.jsonl (every request's span on every device), the
estimated one from the simulator's schedule of the run's own plan (plan.json) for the experiment and
``--set`` overrides the run recorded in run.json. Both are drawn alike (``realloc.search.timeline``):
call boxes labelled with the call's dp/tp/pp and micro-batches where the text fits, iteration ends marked,
short reallocations and transfers widened to stay visible, a legend; each panel on its own time axis
(``--common-scale``: one for both); ``.html`` shows each box's details on hover.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides
from realloc.runtime.records.fused_passes import with_passes
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.records.telemetry import join_sessions
from realloc.search.timeline import check_suffix, estimate_plan, estimated_panel, measured_panel, write_timeline
from realloc.search.turns_report import measured_turn_boxes, turns_from


def parse_iterations(text: str) -> range:
    """``A..B`` (inclusive, counted from 1) or ``N`` (just that one)."""
    lo, sep, hi = text.partition("..")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"--iterations {text!r}: write A..B, e.g. 1..3") from None
    if a < 1 or b < a:
        raise ValueError(f"--iterations {text!r}: need 1 <= A <= B")
    return range(a, b + 1)


def _records(path: Path, whole: bool = False) -> list[dict]:
    """The JSON objects of a run's file (``whole``: the file is one object), one line each; a line that is not
    JSON is one error naming the file and line (the last one is skipped: a killed run's half line), one of another
    shape is skipped (a hand-edited file)."""
    lines = [path.read_text()] if whole else path.read_text().splitlines()
    out = []
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            if not whole and i == len(lines):
                continue  # the last line of a run killed while writing it
            raise ValueError(f"{path}{'' if whole else f' line {i}'} is not JSON ({e.msg}); is it a file of a "
                             f"`realloc run`?") from None
        if isinstance(rec, dict):
            out.append(rec)
    return out or ([{}] if whole else [])


def main(args: argparse.Namespace) -> int:
    run = RunPaths(Path(args.run_dir))
    out = check_suffix(args.timeline)
    for needed in (run.plan, run.root / "requests.jsonl"):
        if not needed.is_file():
            raise ValueError(f"{args.run_dir}: no {needed.name}; is it the directory of a `realloc run`?")
    recorded = _records(run.root / "run.json", whole=True)[0] if (run.root / "run.json").is_file() else {}
    experiment = args.experiment or recorded.get("experiment")
    if not experiment:
        raise ValueError(f"{args.run_dir} has no run.json naming its experiment; pass --experiment EXP")
    spec = load_with_overrides(experiment, recorded.get("overrides", []))
    graph = build_graph(spec)
    plan = ExecutionPlan.load(run.plan)
    # A resumed run's sessions end to end (the time between them, worker start-up included, is not the plan's).
    requests = join_sessions(with_passes([r for r in _records(run.root / "requests.jsonl")
                                          if {"kind", "iteration", "req", "label"} <= r.keys()],
                                         run.root))  # a fused pair's passes
    done = sorted({r["iteration"] for r in requests if r["kind"] == "call"})
    wanted = parse_iterations(args.iterations)
    its = range(wanted.start, min(wanted.stop, (done[-1] + 1) if done else wanted.start))
    if not its:
        raise ValueError(f"--iterations {args.iterations}: the run recorded iterations "
                         f"{done[0] if done else 0}..{done[-1] if done else 0}")
    measured = measured_panel(requests, plan, graph, its)
    # a multi-turn call's turns, from the seconds its environment rank recorded (search/turns_report.py)
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()] \
        if run.metrics.is_file() else []
    panels = [dataclasses.replace(measured, boxes=measured.boxes + tuple(measured_turn_boxes(plan, measured.boxes,
                                                                                             metrics)))]
    if not args.no_estimate:
        # a multi-turn run's estimate is priced on the turns and tool time it recorded (search/turns_report.py)
        space, indices = estimate_plan(build_graph(turns_from(spec, run.root)), plan)
        priced = space.problem.priced_window[1] + 1  # the simulator unrolls a few iterations (and lookahead)
        n = min(len(its), priced)
        panels.append(estimated_panel(space, indices, plan, iterations=n, skip=min(its.start - 1, priced - n)))
    write_timeline(panels, out, common_scale=args.common_scale)
    for p in panels:
        print(p.title)
    print(f"wrote timeline {out}")
    return 0
