"""Audit, ninth round (audit5): multi-turn rollouts, tools, the sandbox and environments at run time. Each test
failed before its fix."""

from __future__ import annotations

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
