"""Tool calls run contained (realloc/tools/sandbox.py): each misbehaving tool ends as an error observation within
its limit, is counted by its status, leaves no process behind, and the caller goes on to the next call."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from realloc.tools.builtin import calculate
from realloc.tools.sandbox import CHILD, Sandbox, ToolLimits, network_isolation, socket_seal

LIMITS = ToolLimits(wall_s=4.0, cpu_s=1, memory_mb=256, output_bytes=4096, max_procs=8)


def _leftovers() -> list[str]:
    """Processes still running this tree's child script (a tool that outlived its call; another checkout's tools,
    e.g. a concurrent demo, are not ours)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if CHILD.encode() in f.read():
                        out.append(pid)
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS, network_isolation())


def test_a_tool_answers_with_what_it_prints_and_returns(sandbox):
    r = sandbox.run("tool_cases:echo", "abc")
    assert (r.status, r.text) == ("ok", "printed ABC")
    assert sandbox.run("realloc.tools.builtin:calculator", "123*45").text == "5535"
    assert sandbox.run("realloc.tools.builtin:python", "print(sum(range(10)))").text == "45\n"


@pytest.mark.parametrize("fn, status, words", [
    ("sleep_forever", "timeout", "wall-time limit of 4 s"),
    ("spin", ("cpu", "timeout"), "limit"),  # CPU time unless 2 loaded cores give it < 1 s in 4 s of wall time
    ("allocate", "memory", "MemoryError"),
    ("flood", "output", "more than 4096 bytes"),
    ("fork_loop", "error", "BlockingIOError"),
])
def test_misbehaving_tools_end_as_an_error_observation_and_the_caller_goes_on(sandbox, fn, status, words):
    start = time.monotonic()
    r = sandbox.run(f"tool_cases:{fn}", "")
    assert r.status in ((status,) if isinstance(status, str) else status)
    assert r.text.startswith("error: ") and words in r.text and len(r.text) < 300
    assert time.monotonic() - start < LIMITS.wall_s + 3.0  # contained within its wall-time limit, not hung
    # the whole process group is gone (fork_loop's children included): killed, so at most still exiting (under a
    # loaded machine a SIGKILLed child can take a moment to leave /proc)
    deadline = time.monotonic() + 5.0
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leftovers() == []
    assert sandbox.run("tool_cases:echo", "next").text == "printed NEXT"


@pytest.mark.parametrize("isolation", ["namespace", "socket_block"])
def test_a_tool_cannot_reach_the_network(isolation):
    if isolation == "namespace" and network_isolation() != "namespace":
        pytest.skip("unshare -n is not available here")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(6)
    got: list[bytes] = []

    def accept() -> None:
        try:
            conn, _ = server.accept()
            got.append(conn.recv(16))
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    r = Sandbox(LIMITS, isolation).run("tool_cases:connect", str(server.getsockname()[1]))
    server.close()
    t.join()
    assert r.status == "error" and r.text.startswith("error: ")
    # the seccomp filter refuses the socket itself; else an empty namespace has no route even to loopback
    refused = isolation == "socket_block" or socket_seal()
    assert ("PermissionError" in r.text) if refused else ("unreachable" in r.text.lower())
    assert got == []  # nothing arrived at the listener on the host's loopback


def test_the_tool_gets_none_of_the_callers_environment(sandbox, monkeypatch):
    monkeypatch.setenv("REALLOC_SECRET_FOR_TEST", "s3cret")
    r = sandbox.run("realloc.tools.builtin:python", "import os; print(sorted(os.environ))")
    assert r.status == "ok" and "REALLOC_SECRET_FOR_TEST" not in r.text


def test_calculator_is_arithmetic_only():
    assert calculate("123*45") == "5535" and calculate("-(7+3)//4") == "-3" and calculate("10/4") == "2.5"
    assert calculate("10/5") == "2"
    for bad in ("__import__('os')", "2**1000", "x+1", "1;2"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_bad_limits_are_one_clear_error():
    with pytest.raises(ValueError, match="ToolLimits.wall_s must be a positive number"):
        ToolLimits(wall_s=0)
    with pytest.raises(ValueError, match=r"env: unknown tool limit\(s\) walltime"):
        ToolLimits.of("env", {"walltime": 3})
