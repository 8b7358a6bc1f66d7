"""Stop signals: the --warning-signal syntax, the sbatch directive, handler installation, and the checkpoint
duration estimate that decides whether a last checkpoint fits before the cluster kills the run."""

import os
import signal
import time

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan
from realloc.models.config import get_model_config
from realloc.runtime.control.program import RuntimeProgram
from realloc.runtime.control.stop_signals import ASSUMED_SAVE_BANDWIDTH, TERM_GRACE, StopSignals, checkpoint_seconds


def test_warning_signal_syntax_and_sbatch_directive():
    s = StopSignals.parse("USR2@300")
    assert s.warning is signal.SIGUSR2 and s.warning_lead == 300.0 and str(s) == "USR2@300"
    assert s.sbatch_directive() == "#SBATCH --signal=B:USR2@300"
    assert s.time_left == {signal.SIGTERM: TERM_GRACE, signal.SIGUSR2: 300.0}
    assert StopSignals.parse("sigusr1@120") == StopSignals()
    for bad, why in (("USR1", "SIGNAL@SECONDS"), ("NOPE@5", "SIGNAL@SECONDS"), ("TERM@60", "cannot be the warning"),
                     ("KILL@60", "cannot be the warning"), ("USR1@0", "at least 1 second")):
        with pytest.raises(ValueError, match=why):
            StopSignals.parse(bad)


def test_catch_calls_back_and_restores_the_previous_handlers():
    got, before = [], []
    previous = signal.signal(signal.SIGUSR1, lambda *_: before.append(1))
    try:
        restore = StopSignals().catch(got.append)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        restore()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1] and before == [1]


def test_checkpoint_estimate_is_the_busiest_workers_shards_unless_one_was_measured():
    spec = load_experiment("experiments/ppo_tiny.py")
    g = build_graph(spec)
    # The actor trains across both devices (dp=2: each holds all of it), the critic on device 1 only.
    where = {"actor_gen": "localhost:0", "rew_inf": "localhost:0", "ref_inf": "localhost:1",
             "critic_inf": "localhost:1", "actor_train": "localhost", "critic_train": "localhost:1"}
    plan = ExecutionPlan(experiment=spec.name, graph_digest=g.digest, nodelist="localhost", n_devices_per_node=2,
                         device="cpu", placements={c: CallPlacement(mesh=m, dp=2 if m == "localhost" else 1, tp=1,
                                                                    pp=1, n_mbs=1) for c, m in where.items()})
    program = RuntimeProgram(g, plan)
    actor, critic = get_model_config("tiny").total_params, get_model_config("tiny-critic").total_params
    per_param = 4 + 8  # fp32 parameters on CPU, two fp32 AdamW moments
    want = (actor + critic) * per_param / ASSUMED_SAVE_BANDWIDTH
    assert checkpoint_seconds(program, 2, None) == pytest.approx(want, rel=1e-12)
    assert checkpoint_seconds(program, 2, 3.5) == 3.5
