"""Environments for tests/test_multiturn.py (workers import them by module path)."""

from __future__ import annotations

from realloc.tools.sandbox import Sandbox, ToolLimits

CHARACTERS = "0123456789+-*=<>/ abcdefghijklmnopqrstuvwxyz"  # with 4 specials: 49 ids, under the tiny model's 64


class LengthEnv:
    """Answers each turn with the length of what the policy said (through the calculator tool when ``tool``),
    rewards 0.25 per turn and, on the last turn, the turn's length mod 3. With ``stop_even`` a turn of even length
    is the last too (rollouts then take different numbers of turns). With ``tool_fns`` ("module:function" tools,
    tests/tool_cases.py's misbehaving ones) step k runs the k-th of them instead and answers with its status."""

    def __init__(self, turns: int = 3, tool: bool = False, stop_even: bool = False, tool_fns: tuple = (),
                 wall_s: float = 20.0) -> None:
        self.turns, self.tool, self.t, self.stop_even, self.tool_fns = turns, tool, 0, stop_even, tuple(tool_fns)
        self.sandbox = Sandbox(ToolLimits(wall_s=wall_s)) if tool else None
        self.tool_counts: dict[str, int] = {}  # read by the generation's stats, as ToolEnv's

    def reset(self, record: dict) -> str:
        self.t = 0
        return "<" + str(record.get("answer", "")) + ">"

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.t += 1
        if self.t >= self.turns or (self.stop_even and len(text) % 2 == 0):
            return None, float(len(text) % 3), True
        n = str(len(text))
        if self.sandbox is not None:
            fn = self.tool_fns[(self.t - 1) % len(self.tool_fns)] if self.tool_fns else None
            result = self.sandbox.run(fn or "realloc.tools.builtin:calculator", f"{n}*1")
            self.tool_counts[result.status] = self.tool_counts.get(result.status, 0) + 1
            n = result.status if fn else result.text
        return f"<{n}>", 0.25, False


def make_env(**kw: object) -> LengthEnv:
    return LengthEnv(**kw)  # type: ignore[arg-type]


class BrokenEnv(LengthEnv):
    def step(self, text: str) -> tuple[str | None, float, bool]:
        raise RuntimeError("the grader is down")


def make_broken(**kw: object) -> BrokenEnv:
    return BrokenEnv(**kw)  # type: ignore[arg-type]


class ParallelCallsEnv:
    """ToolEnv's chat format with two calls in every turn (parallel calls, tests/test_leftovers3.py): each turn
    of length n is handed over as calls of n*1 and n+1, answered ``<n><n+1>``; the third turn is the final one."""

    def __init__(self, turns: int = 3) -> None:
        from realloc.envs.tool_env import ToolEnv

        self.env = ToolEnv(call_format="chat", result_format="<{}>", limits={"wall_s": 20.0}, call_reward=0.125)
        self.turns, self.t = turns, 0

    @property
    def tool_counts(self) -> dict[str, int]:
        return self.env.tool_counts

    def reset(self, record: dict) -> str:
        self.t = 0
        return self.env.reset(record)

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.t += 1
        if self.t >= self.turns:
            return None, 1.0, True
        call = '<tool_call>{{"name": "calculator", "arguments": "{}"}}</tool_call>'
        return self.env.step(call.format(f"{len(text)}*1") + call.format(f"{len(text)}+1"))


def make_parallel(**kw: object) -> ParallelCallsEnv:
    return ParallelCallsEnv(**kw)  # type: ignore[arg-type]
