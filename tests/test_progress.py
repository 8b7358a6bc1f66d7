"""Progress inside an iteration (issue 22 item 15): which call is running, for how long, and the ETA; without a
terminal, plain lines per iteration and per long call. ``RunProgress`` on a hand-driven clock, then the
console of a real ``Master`` driven by fake workers whose calls are slow."""

from __future__ import annotations

import re

from fake_workers import FakeWorkers
from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.runtime.control.master import Master
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.records.metric_sinks import MetricSinks
from realloc.runtime.records.progress import RunProgress, duration
from realloc.runtime.records.run_paths import RunPaths
from realloc.runtime.run_cli import _drive
from realloc.runtime.wire import protocol
from run_helpers import TINY, disjoint_plan


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_like_a_person_writes_them():
    assert [duration(x) for x in (0.4, 42, 59.6, 185, 3600 + 7 * 60 + 20)] == ["0 s", "42 s", "1m00s", "3m05s",
                                                                               "1h07m"]


def test_status_eta_and_long_call_lines_on_a_hand_driven_clock():
    clock = Clock()
    p = RunProgress(total=10, start=2, long_call=60.0, clock=clock)  # resumed after 2: 8 iterations to go
    assert p.status().startswith("starting workers") and p.eta() is None
    p.node("actor_gen", 3, None)
    clock.now += 12
    p.node("ref_inf", 3, None)
    p.node("actor_gen", 4, None)  # the next iteration's generation overlaps: not the oldest iteration
    clock.now += 3
    assert p.status() == "iteration 3: actor_gen 15 s, ref_inf 3 s | ETA ?"
    assert p.long_lines() == []
    clock.now += 50  # actor_gen of iteration 3 has run 65 s, the other two 53 s
    assert p.long_lines() == ["iter 3/10 | actor_gen running for 1m05s"]
    assert p.long_lines() == []  # once per long_call seconds
    clock.now += 60
    assert p.long_lines() == ["iter 3/10 | actor_gen running for 2m05s", "iter 3/10 | ref_inf running for 1m53s",
                              "iter 4/10 | actor_gen running for 1m53s"]
    assert p.node("actor_gen", 3, 125.0) == "iter 3/10 | actor_gen done in 2m05s"
    assert p.node("ref_inf", 3, 4.0) == "iter 3/10 | ref_inf done in 4 s"  # reported while running: says it ended
    p.node("critic_inf", 3, None)
    assert p.node("critic_inf", 3, 2.0) is None  # short and never reported: no line
    p.iteration_done()  # iteration 3 ends 125 s after the start: the only measure yet
    assert p.eta() == 7 * 125.0
    clock.now += 10
    p.iteration_done()  # iteration 4: 10 s after 3, so the mean after the first is 10 s
    assert p.eta() == 6 * 10.0 and p.eta_text() == "ETA 1m00s"
    assert p.status() == "iteration 4: actor_gen 2m03s | ETA 1m00s"  # started at 112, now 235


def test_the_first_eta_does_not_count_starting_the_workers():
    """Workers take 40 s to load, the first iteration 10 s: the ETA after it is 10 s per iteration left, not 50;
    while they load the status says so instead of ``ETA ?``."""
    clock = Clock()
    p = RunProgress(total=5, start=0, clock=clock)
    clock.now += 40
    assert p.status() == "starting workers: importing, loading models and data (40 s)"
    assert p.workers_ready() == "workers ready after 40 s; training"
    assert p.status() == "ETA ?"
    clock.now += 10
    p.iteration_done()
    assert p.eta() == 4 * 10.0


def test_plain_output_names_each_long_call_and_ends_iterations_with_the_eta(tmp_path, capsys):
    spec = load_experiment(TINY)
    graph = build_graph(spec)
    secret = protocol.new_secret()
    master = Master(RuntimeProgram(graph, disjoint_plan()), RunConfig.of(spec), RunPaths(tmp_path), "r1", secret,
                    iterations=3, heartbeat_timeout=600.0)
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    sinks = MetricSinks.open(tmp_path, tensorboard=False, wandb_project=None, run_name="t", config={},
                             first_iteration=1)
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs,
                     delays={"call": 1.1}):
        _drive(master, total=3, start=0, sinks=sinks, quiet=True, long_call=1.0)
    sinks.close()
    lines = capsys.readouterr().out.splitlines()
    iters = [x for x in lines if re.match(r"iter \d/3 \| reward", x) or re.match(r"iter \d/3 \| .*s/it", x)]
    assert len(iters) == 3 and all(re.search(r"\| ETA (\d+ s|\d+m\d\ds)$", x) for x in iters), lines
    assert iters[-1].endswith("| ETA 0 s")
    done = [x for x in lines if " done in " in x]
    # every call of every iteration took over a second (the fake workers hold each call 1.1 s)
    for t in (1, 2, 3):
        for call in graph.topo_order:
            assert any(x.startswith(f"iter {t}/3 | {call} done in ") for x in done), (t, call, lines)
    assert not any("\x1b" in x for x in lines)  # plain text: no terminal control codes
    # the workers' start is said, before the first iteration's line
    start = lines.index("starting 2 workers (importing, loading models and data)")
    ready = next(i for i, x in enumerate(lines) if re.fullmatch(r"workers ready after \d+ s; training", x))
    assert start < ready < lines.index(iters[0])


def test_async_runs_show_staleness_on_the_console_line_and_in_the_done_summary(tmp_path, capsys):
    """Bounded staleness: each iteration's line says how many train steps behind its samples' parameters were,
    an iteration that took no time of its own says why, and the ``done:`` line gives the run's largest and mean
    staleness (the mean of the iterations' means, by hand: (1 + 0.5) / 2)."""
    from realloc.runtime.records.telemetry import RunStats, format_line
    from realloc.runtime.records.startup import StartupClock
    from realloc.runtime.run_cli import _summary

    def metrics(it: int, time: float, worst: int, mean: float) -> dict:
        return {"iteration": it, "reward": 0.5, "time": {"actor_gen": 0.2}, "iteration_time": time, "tokens": 64,
                "tokens_per_s": 64 / time if time else None,
                "staleness": {"max": worst, "mean": mean, "versions": {"actor_gen": it - 1 - worst}}}

    first, second = metrics(2, 1.0, 1, 1.0), metrics(3, 0.0, 0, 0.5)
    assert "| staleness 1 (mean 1.00) |" in format_line(first, 10)
    line = format_line(second, 10)
    assert "staleness 0 (mean 0.50)" in line and line.endswith("0 s of its own: done before the previous iteration "
                                                               "finished (its work overlapped it)")
    no_async = {k: v for k, v in first.items() if k != "staleness"}
    assert "staleness" not in format_line(no_async, 10)
    stats = RunStats(2)
    stats.start(0.0)
    stats.on_iteration(first, 1.0)
    stats.on_iteration(second, 1.0)
    summary = stats.summary()
    assert summary["staleness"] == {"max": 1, "mean": 0.75}
    _summary(summary, RunPaths(tmp_path), StartupClock())
    [done] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("done:")]
    assert ", staleness max 1 mean 0.75," in done
    stats = RunStats(2)
    stats.start(0.0)
    stats.on_iteration(no_async, 1.0)
    assert "staleness" not in stats.summary()
