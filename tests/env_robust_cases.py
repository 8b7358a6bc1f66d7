"""Environments for tests/test_env_robust.py (workers import them by module path)."""

from __future__ import annotations

from realloc.tools.sandbox import Sandbox, ToolLimits
from tests.multiturn_cases import LengthEnv


class NoExec(Sandbox):
    """A sandbox whose every call fails to start: its Python cannot be executed (a failed exec, as a full disk or
    EAGAIN on fork would fail it)."""

    def _command(self) -> list[str]:
        return ["/nonexistent/python3"]


class InfraEnv(LengthEnv):
    """Calls the calculator each turn through a sandbox that cannot start it (every call, or every other one with
    ``every_other``) and answers with the call's status; keeps ``infra_error`` as ToolEnv does."""

    def __init__(self, every_other: bool = False, **kw: object) -> None:
        super().__init__(tool=True, **kw)  # type: ignore[arg-type]
        self.every_other, self.calls, self.infra_error = every_other, 0, ""
        self.broken = NoExec(ToolLimits())

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.t += 1
        if self.t >= self.turns:
            return None, 1.0, True
        self.calls += 1
        sandbox = self.broken if not self.every_other or self.calls % 2 == 1 else self.sandbox
        assert sandbox is not None
        r = sandbox.run("realloc.tools.builtin:calculator", "1+1")
        self.tool_counts[r.status] = self.tool_counts.get(r.status, 0) + 1
        if r.status == "infra":
            self.infra_error = r.text
        return f"<{r.status}>", 0.25, False


def make_infra(**kw: object) -> InfraEnv:
    return InfraEnv(**kw)  # type: ignore[arg-type]


class HugeEnv(LengthEnv):
    """Answers every turn with an observation of ``chars`` characters (far past any budget); the first observation
    too when ``first``."""

    def __init__(self, chars: int = 1 << 20, first: bool = False, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.chars, self.first = chars, first

    def reset(self, record: dict) -> str:
        return huge(self.chars, 0) if self.first else "<>"

    def step(self, text: str) -> tuple[str | None, float, bool]:
        obs, reward, done = super().step(text)
        return (None if obs is None else huge(self.chars, self.t)), reward, done


def huge(chars: int, seed: int) -> str:
    """``chars`` characters of the test tokenizer's alphabet, words and runs of spaces, from ``seed``."""
    words = ["12", "3+4", "abc", "  ", "x=y", "7", "<", ">", "zz", "9 9"]
    period = " ".join(words[(seed + i * 7) % len(words)] for i in range(97)) + " "
    return (period * (chars // len(period) + 1))[:chars]


def make_huge(**kw: object) -> HugeEnv:
    return HugeEnv(**kw)  # type: ignore[arg-type]
