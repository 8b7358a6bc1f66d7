"""``ToolEnv``: the built-in tool-calling environment (``interface_args={"env": "tools", "env_args": {...}}``).

The format (documented in docs/multi-turn.md). A policy's turn calls a tool by writing ``<NAME>INPUT</NAME>``
with NAME one of the environment's tools, e.g. ``<calculator>123*45</calculator>``; the first such call of a turn
runs (text after it is ignored), in the sandbox (``realloc/tools/sandbox.py``), and its answer comes back as the
next observation, ``<result>5535</result>`` (``result_format``; a failure reads ``<result>error: ...</result>``).
A turn without a tool call is the final answer: the rollout ends and ``rule(prompt, answer_text, reference)``
scores it against the record's ``field`` (``exact_match`` by default: the answer's first number). Each tool call
may add ``call_reward`` (a small cost or bonus; 0 by default), so rewards can be per turn as well as final.

``call_format="chat"`` reads a chat model's own tool calls instead, ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` (Qwen2, Hermes), and writes each answer as the ``chat_template`` renders a ``tool`` message, the next
assistant turn's prompt included (``chat_tools.py``); without a template, ``result_format`` as above.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from realloc.envs.chat_tools import ChatObservation, parse_tool_call
from realloc.envs.resolve import resolve_function
from realloc.tools.builtin import BUILTIN_TOOLS
from realloc.tools.sandbox import STATUSES, Sandbox, ToolLimits, network_isolation


FORMATS = ("tags", "chat")


class ToolEnv:
    def __init__(self, tools: Mapping[str, str] | list[str] = ("calculator",), field: str = "answer",
                 rule: Any = "exact_match", limits: Mapping[str, Any] | ToolLimits | None = None,
                 result_format: str = "<result>{}</result>", call_reward: float = 0.0,
                 first_observation: str = "", call_format: str = "tags", chat_template: str | None = None,
                 end_of_turn: str = "<|im_end|>") -> None:
        where = "ToolEnv"
        if call_format not in FORMATS:
            raise ValueError(f"{where}: call_format must be one of {', '.join(FORMATS)}, got {call_format!r}")
        if isinstance(tools, str) or not tools:
            raise ValueError(f"{where}: tools must be a list of built-in names ({', '.join(BUILTIN_TOOLS)}) or a "
                             f"dict name -> 'module:function'")
        named = {t: t for t in tools} if not isinstance(tools, Mapping) else dict(tools)
        self.tools: dict[str, str] = {}
        for name, fn in named.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{where}: tool name {name!r} must be an identifier (it is written as <{name}>)")
            fn = BUILTIN_TOOLS.get(fn, fn)
            if not isinstance(fn, str) or ":" not in fn:
                raise ValueError(f"{where}: tool {name!r} must be a built-in name ({', '.join(BUILTIN_TOOLS)}) or "
                                 f"'module:function' (it runs in a fresh process, so it is named, not passed)")
            self.tools[name] = fn
        if "{}" not in result_format:
            raise ValueError(f"{where}: result_format must contain {{}} where the tool's answer goes")
        self.rule = _rule(rule)
        self.field, self.result_format, self.call_reward = field, result_format, float(call_reward)
        self.first_observation = first_observation
        self.sandbox = Sandbox(ToolLimits.of(where, limits), network_isolation())
        names = "|".join(re.escape(n) for n in self.tools)
        self._call = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)
        self.counts = {s: 0 for s in STATUSES}
        self.reference = ""
        self.chat = call_format == "chat"
        self.render = (ChatObservation(where, chat_template, end_of_turn).observation if chat_template is not None
                       else result_format.format)

    def reset(self, record: Mapping[str, Any]) -> str:
        if self.field not in record:
            raise ValueError(f"ToolEnv: the prompt record has no field {self.field!r} (it has "
                             f"{', '.join(sorted(record)) or 'none'}); set env_args['field']")
        self.reference = str(record[self.field])
        return self.first_observation

    def step(self, text: str) -> tuple[str | None, float, bool]:
        call = self._find(text)
        if call is None:
            return None, float(self.rule("", text, self.reference)), True
        if isinstance(call, str):  # a malformed chat tool call: the policy reads why
            self.counts["error"] += 1
            return self.render(call), self.call_reward, False
        result = self.sandbox.run(self.tools[call[0]], call[1])
        self.counts[result.status] += 1
        return self.render(result.text.strip()), self.call_reward, False

    def _find(self, text: str) -> tuple[str, str] | str | None:
        """The turn's first tool call as (tool, input), an error text, or None (a final answer)."""
        if self.chat:
            return parse_tool_call(text, self.tools)
        m = self._call.search(text)
        return None if m is None else (m.group(1), m.group(2))

    @property
    def tool_counts(self) -> dict[str, int]:
        """Calls by outcome (``sandbox.STATUSES``), for the generation's stats."""
        return dict(self.counts)


def _rule(rule: Any) -> Any:
    if rule == "exact_match":
        from realloc.algorithms.rewards.text_rules import exact_number_match

        return exact_number_match
    return resolve_function("ToolEnv", rule, "rule")
