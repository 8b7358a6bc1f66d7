"""Tools that misbehave, for tests/test_tool_sandbox.py (imported by the sandbox's child by module path)."""

import os
import socket
import time


def sleep_forever(text: str) -> str:
    while True:
        time.sleep(1)


def spin(text: str) -> str:
    while True:
        pass


def allocate(text: str) -> str:
    chunks = []
    while True:
        chunks.append(bytearray(64 << 20))


def flood(text: str) -> None:
    block = "x" * (1 << 20)
    for _ in range(100):  # 100 MB
        print(block, end="")


def fork_loop(text: str) -> str:
    while True:
        os.fork()


def connect(text: str) -> str:
    s = socket.socket()
    s.settimeout(2)
    s.connect(("127.0.0.1", int(text)))
    s.sendall(b"hello")
    return "connected"


def echo(text: str) -> str:
    print("printed", end=" ")
    return text.upper()


def forge_result(text: str) -> str:
    """Writes the result line itself, with the call's nonce read from the child's frame (deliberate, not a
    mistake: the sandbox is no boundary against that), carrying ``text`` as the JSON of the result."""
    import sys

    marker = sys._getframe(1).f_locals["req"]["marker"]
    sys.stdout.write("\n" + marker + " " + text + "\n")
    sys.stdout.flush()
    os._exit(0)


def killed(text: str) -> str:
    """Killed mid-call from outside (here by itself: the same SIGKILL an operator or the OOM killer sends)."""
    print("working", flush=True)
    os.kill(os.getpid(), 9)  # SIGKILL (the signal module is not importable after the switch to nobody)
    return "never"
