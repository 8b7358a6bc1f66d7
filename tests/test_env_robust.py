"""Robustness of multi-turn environments and the tool sandbox (docs/multi-turn.md, "How a tool is contained"):
a tool's files are capped in total, not only per file; a sandbox that cannot start a tool (no space, a failed fork
or exec) is an observation and a counted status, and stops the run only when every call fails so; a huge
observation is cut before it is tokenized, to the very tokens tokenize-then-cut gives."""

from __future__ import annotations

import errno
import subprocess
import tempfile

import pytest

from realloc.envs.tool_health import INFRA_STREAK, InfraWatch
from realloc.tools.sandbox import Sandbox, ToolLimits, _verdict, network_isolation

WRITER = "for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))\nprint('wrote', i + 1)"


# -- the total of a tool's files --------------------------------------------------------------------------------
def test_a_tool_that_writes_many_files_is_stopped_at_the_total_cap_and_one_under_it_is_not():
    # each file (4 MB) is under file_mb; 20 of them (80 MB) filled the disk before, with no total cap
    sandbox = Sandbox(ToolLimits(file_mb=8, disk_mb=12, wall_s=20, cpu_s=10), network_isolation())
    r = sandbox.run("realloc.tools.builtin:python", WRITER)
    assert (r.status, r.text) == ("disk", "error: the tool wrote more than 12 MB of files and was stopped")
    roomy = Sandbox(ToolLimits(file_mb=8, disk_mb=100, wall_s=20, cpu_s=10), network_isolation())
    assert roomy.run("realloc.tools.builtin:python", WRITER).text == "wrote 20\n"
    assert sandbox.run("realloc.tools.builtin:calculator", "6*7").text == "42"  # and the next call works


def test_the_total_cap_is_a_checked_limit():
    assert ToolLimits().disk_mb == 64
    with pytest.raises(ValueError, match="ToolLimits.disk_mb must be a positive number, got 0"):
        ToolLimits(disk_mb=0)
    with pytest.raises(ValueError, match="env: unknown tool limit"):
        ToolLimits.of("env", {"disk": 1})


# -- the sandbox's own failures -----------------------------------------------------------------------------------
def _no_space(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_fork(*_a, **_k):
    raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")


@pytest.mark.parametrize("target, fail, words", [
    (tempfile, ("mkdtemp", _no_space), "OSError: [Errno 28] No space left on device"),
    (subprocess, ("Popen", _no_fork), "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
])
def test_a_sandbox_that_cannot_start_the_tool_answers_with_an_observation(monkeypatch, target, fail, words):
    monkeypatch.setattr(target, *fail)
    r = Sandbox(ToolLimits(), "socket_block").run("realloc.tools.builtin:calculator", "1+1")
    assert (r.status, r.text) == ("infra", "error: the tool could not be started: " + words)


def test_the_keeper_s_failed_fork_reads_as_infra():
    line = '\n\x00m {"ok": false, "error": "BlockingIOError: [Errno 11] Resource temporarily unavailable", ' \
           '"infra": true}\n'
    assert _verdict(0, line, "\x00m", ToolLimits()) == (
        "infra", "error: the tool could not be started: BlockingIOError: [Errno 11] Resource temporarily unavailable")


def test_a_failed_exec_is_counted_by_the_tool_environment_which_goes_on():
    from realloc.envs.tool_env import ToolEnv
    from tests.env_robust_cases import NoExec

    env = ToolEnv()
    env.reset({"answer": "2"})
    good, env.sandbox = env.sandbox, NoExec(ToolLimits())
    obs, _, done = env.step("<calculator>1+1</calculator>")
    assert not done and obs.startswith("<result>error: the tool could not be started: FileNotFoundError")
    env.sandbox = good
    assert env.step("<calculator>1+1</calculator>")[0] == "<result>2</result>"
    assert env.tool_counts["infra"] == 1 and env.tool_counts["ok"] == 1 and env.infra_error.startswith("error: ")


class _Env:
    def __init__(self) -> None:
        self.tool_counts = {"ok": 0, "infra": 0}
        self.infra_error = ""


def test_the_run_stops_after_a_streak_of_infra_failures_and_any_started_call_resets_it():
    envs = [_Env(), _Env()]
    watch = InfraWatch()

    def turn(infra: int, ok: int) -> None:
        before = watch.counts(envs)
        envs[0].tool_counts["infra"] += infra
        envs[1].tool_counts["ok"] += ok
        if infra:
            envs[0].infra_error = "error: the tool could not be started: OSError: [Errno 28] No space left on device"
        watch.turn("call 'gen'", envs, before)

    turn(INFRA_STREAK - 1, 0)
    turn(INFRA_STREAK - 1, 1)  # a call that started: the count starts again
    turn(0, 0)
    with pytest.raises(RuntimeError) as e:
        turn(1, 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"call 'gen': the last {INFRA_STREAK} tool calls could not be started")
    assert "OSError: [Errno 28] No space left on device" in msg


# -- inside a GENERATE call ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from mp_pool import GlooPool

    with GlooPool(1, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from realloc.demo.arith_task import train_tokenizer
    from tests.multiturn_cases import CHARACTERS

    return str(train_tokenizer(tmp_path_factory.mktemp("tok"), CHARACTERS))


def _run(ctx, tokenizer_dir: str, env: dict):
    from tests.test_multiturn import ENV, _generate

    try:
        return _generate(ctx, tokenizer_dir, 1, 1, 1, {**ENV, **env})["sums"]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_infra_failures_are_observations_until_every_call_fails(pool, tokenizer_dir):
    # 4 rollouts, 3 tool turns each: the first and third calls fail, the second starts; every rollout goes on
    env = {"env": "env_robust_cases:make_infra", "max_turns": 4}
    sums = pool.run(_run, tokenizer_dir, {**env, "env_args": {"turns": 4, "every_other": True}})[0]
    assert isinstance(sums, dict), sums
    assert sums["tool_infra"] == 8 and sums["tool_ok"] == 4 and sums["env_obs_steps"] == 12
    # every call fails: the call stops after INFRA_STREAK of them (the second turn), naming the cause in one line
    err = pool.run(_run, tokenizer_dir, {**env, "env_args": {"turns": 4}})[0]
    assert err.startswith(f"RuntimeError: call 'actor_gen': the last {INFRA_STREAK} tool calls could not be "
                          f"started (the machine, not the tools: the tool could not be started: FileNotFoundError")
    assert "\n" not in err
