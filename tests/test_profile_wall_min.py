"""`realloc profile --clock wall-min`: each point the fastest of its repeats (docs/estimator.md, "Where a
generation's time goes": on a loaded machine another process only adds wall time to a short op)."""

from __future__ import annotations

import argparse
import statistics

from realloc.cli import build_parser
from realloc.estimator.profile_cli import build_job
from realloc.estimator.profiler import timed


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["profile", *argv])


def scripted_clock(durations: list[float]):
    """A clock whose consecutive (start, end) readings are ``durations`` apart, one pair per run."""
    ticks, now = [], 0.0
    for d in durations:
        ticks += [now, now + d]
        now += d + 1.0
    it = iter(ticks)
    return lambda: next(it)


def test_wall_min_keeps_the_fastest_repeat_and_the_default_the_median():
    runs = [0.5, 0.3, 0.9, 0.2, 0.7]  # warm-up 1, then 4 samples
    for statistic, want in ((statistics.median, statistics.median(runs[1:])), (min, min(runs[1:]))):
        got = timed(lambda: None, None, 1, 4, clock=scripted_clock(runs), statistic=statistic)
        assert abs(got - want) < 1e-12


def test_wall_min_is_a_clock_of_every_layout():
    assert build_job(parse("--model", "tiny", "--tp", "1,2", "--clock", "wall-min")).clock == "wall-min"
    assert build_job(parse("--model", "tiny")).clock == "wall"
