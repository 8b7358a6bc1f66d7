"""Tools and environments that misbehave, for tests/test_audit_round9.py (the sandbox's child imports the tools by
module path)."""

import os
import time


def daemon(text: str) -> str:
    """Starts a daemon the usual way (fork, setsid, fork again), which sleeps for a minute; then returns, or,
    when ``text`` is "hang", outstays its wall time."""
    first = os.fork()
    if first == 0:
        os.setsid()  # a session of its own: a kill of the tool's process group does not reach it
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    os.waitpid(first, 0)
    while text == "hang":
        time.sleep(1)
    return "started"


class SurrogateEnv:
    """Answers with text decoded by ``errors="surrogateescape"`` from bytes that are not UTF-8 (a lone surrogate)."""

    def reset(self, record: dict) -> str:
        return ""

    def step(self, text: str) -> tuple[str | None, float, bool]:
        return b"<\xff>".decode("utf-8", errors="surrogateescape"), 0.0, False


def make_surrogate(**kw: object) -> SurrogateEnv:
    return SurrogateEnv()


def kill_all(text: str) -> str:
    """kill(-1, SIGKILL): every process its user may signal (a policy's program can write it)."""
    os.kill(-1, 9)
    return "still here"


def make_dict(**kw: object) -> dict:
    """A factory that returns its settings instead of an environment."""
    return dict(kw)
