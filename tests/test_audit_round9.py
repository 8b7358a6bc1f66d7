"""Audit, ninth round (audit5): multi-turn rollouts, tools, the sandbox and environments at run time. Each test
failed before its fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from realloc.tools.sandbox import Sandbox, ToolLimits, network_isolation
from tests.test_tool_sandbox import _leftovers


@pytest.mark.parametrize("how, status", [("return", "ok"), ("hang", "timeout")])
def test_a_daemon_a_tool_starts_in_a_session_of_its_own_dies_with_the_call(how, status):
    # A fork + setsid + fork daemon left the tool's process group, so the group kill at the end of the call missed
    # it: it outlived the call (and the run), and as `nobody` counted against every later call's process limit.
    r = Sandbox(ToolLimits(wall_s=3.0, max_procs=8), network_isolation()).run("audit9_cases:daemon", how)
    assert r.status == status
    deadline = time.monotonic() + 5.0
    while _leftovers() and time.monotonic() < deadline:  # SIGKILLed, at most still leaving /proc
        time.sleep(0.05)
    assert _leftovers() == []


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_daemon_of_a_tool_dies_with_a_killed_worker(tmp_path):
    # The tool's process died with its worker (parent-death signal), but its daemon, in a session of its own,
    # lived on; now the keeper gets SIGTERM when the worker dies and ends every process of the tool first.
    code = ("import sys; sys.path.insert(0, %r); from realloc.tools.sandbox import Sandbox, ToolLimits; "
            "Sandbox(ToolLimits(wall_s=600)).run('audit9_cases:daemon', 'hang')" % os.path.dirname(__file__))
    worker = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while len(_leftovers()) < 3 and time.monotonic() < deadline:  # the keeper, the tool and its daemon
            time.sleep(0.1)
        assert len(_leftovers()) >= 3, "the daemon never started"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 10
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _leftovers()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert left == []
