"""``ToolEnv``: the built-in tool-calling environment (``interface_args={"env": "tools", "env_args": {...}}``).

The format (documented in docs/multi-turn.md). A policy's turn calls a tool by writing ``<NAME>INPUT</NAME>``
with NAME one of the environment's tools, e.g. ``<calculator>123*45</calculator>``; the first such call of a turn
runs (text after it is ignored; the chat format below runs every call of a turn, up to ``max_calls``), in the
sandbox (``realloc/tools/sandbox.py``), and its answer comes back as the next observation,
``<result>5535</result>`` (``result_format``; a failure reads ``<result>error: ...</result>``). A turn without a
tool call is the final answer: the rollout ends and ``rule(prompt, answer_text, reference)`` scores it against
the record's ``field`` (``exact_match`` by default: the answer's first number). Each tool call may add
``call_reward`` (a small cost or bonus; 0 by default), so rewards can be per turn as well as final.

``call_format="chat"`` reads a chat model's own tool calls instead, in the format its ``chat_template`` writes them
(``chat_format.py``: Qwen's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Llama 3's bare JSON with
"parameters", Mistral's ``[TOOL_CALLS] [...]``; Hermes' ``<tool_call>`` without a template), and writes each answer as
the template renders a ``tool`` message, the next assistant turn's prompt included (``chat_tools.py``); without a
template, ``result_format`` as above.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
from typing import Any, Mapping

from realloc.envs.chat_format import HERMES, chat_format, tool_input
from realloc.envs.chat_tools import ChatObservation
from realloc.envs.resolve import resolve_function
from realloc.tools.builtin import BUILTIN_TOOLS
from realloc.tools.declared import env_tools
from realloc.tools.keywords import keyword_arguments
from realloc.tools.sandbox import STATUSES, Sandbox, ToolLimits, network_isolation


FORMATS = ("tags", "chat")


class ToolEnv:
    def __init__(self, tools: Mapping[str, str] | list[str] = ("calculator",), field: str = "answer",
                 rule: Any = "exact_match", limits: Mapping[str, Any] | ToolLimits | None = None,
                 result_format: str = "<result>{}</result>", call_reward: float = 0.0,
                 first_observation: str = "", call_format: str = "tags", chat_template: str | None = None,
                 end_of_turn: str | None = None, max_calls: int = 8) -> None:
        where = "ToolEnv"
        tools, self.keyword_tools = env_tools(where, tools)  # declared tools (tools/declared.py): run by name
        self.tools, checked = _checked(where, tools, call_format, result_format, limits, call_reward, max_calls)
        self.max_calls = max_calls  # calls one turn runs (chat format); each has its own ToolLimits
        self.rule = _rule(rule)
        self.field, self.result_format, self.call_reward = field, result_format, float(call_reward)
        self.first_observation = first_observation
        self.sandbox = Sandbox(checked, network_isolation())
        names = "|".join(re.escape(n) for n in self.tools)
        self._call = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)
        self.counts = {s: 0 for s in STATUSES}
        self.reference = ""
        self.infra_error = ""  # the last call the sandbox could not start (tools/sandbox.py: "infra")
        self.unstarted = 0  # calls answered without running (malformed, no such tool, past max_calls): tool_health.py
        self.chat = call_format == "chat"
        chat = ChatObservation(where, chat_template, end_of_turn) if chat_template is not None else None
        self.format = chat.format if chat is not None else HERMES
        self.render = chat.observations if chat is not None else \
            lambda answers: "".join(result_format.format(a[0]) for a in answers)

    def reset(self, record: Mapping[str, Any]) -> str:
        if self.field not in record:
            raise ValueError(f"ToolEnv: the prompt record has no field {self.field!r} (it has "
                             f"{', '.join(sorted(record)) or 'none'}); set env_args['field']")
        self.reference = str(record[self.field])
        return self.first_observation

    def step(self, text: str) -> tuple[str | None, float, bool]:
        try:
            calls = self._find(text)
        except RecursionError:  # JSON nested deeper than the interpreter's stack: the policy's mistake, not the run's
            calls = ["error: the tool call is not JSON (nested too deeply)"]
        if calls is None:
            return None, float(self.rule("", text, self.reference)), True
        answers = []  # (answer, tool, call id): every call of the turn, in order, each answered
        for k, call in enumerate(calls):
            # a call past max_calls is not run, but answered as the call it is (its tool, and its id: Mistral's)
            own = (call[0], call[2] if len(call) > 2 else None) if isinstance(call, tuple) else (None, None)
            if k >= self.max_calls:
                call = f"error: at most {self.max_calls} tool calls run in one turn (env_args['max_calls'])"
            if isinstance(call, str):  # a malformed chat tool call: the policy reads why
                self.counts["error"] += 1
                self.unstarted += 1
                answers.append((call, *own))
                continue
            # a tool described by its signature (tools/declared.py) is called with the arguments as keywords
            keywords = call[1] if isinstance(call[1], dict) else None
            result = self.sandbox.run(self.tools[call[0]], "" if keywords is not None else call[1], keywords)
            self.counts[result.status] += 1
            if result.status == "infra":  # named by envs/tool_health.py if every call fails so
                self.infra_error = result.text
            answers.append((result.text.strip(), *own))
        return self.render(answers), self.call_reward * len(answers), False

    def _find(self, text: str) -> list[tuple[str, Any] | tuple[str, Any, str | None] | str] | None:
        """The turn's tool calls, in order, each as (tool, input) or, in the chat format, (tool, input, call id), or
        an error text; None for a final answer. The input of a tool called with keywords is their dict. The tags
        format runs the turn's first call; the chat format every call (parallel calls)."""
        if self.chat:
            got = self.format.parse_calls(text, self.tools)
        else:
            m = self._call.search(text)
            got = None if m is None else [(m.group(1), m.group(2))]
        return None if got is None else [self._input(c) for c in got]

    def _input(self, got: tuple[str, Any] | tuple[str, Any, str | None] | str) -> Any:
        if not isinstance(got, tuple):
            return got
        if got[0] not in self.keyword_tools:
            return (got[0], tool_input(got[1]), *got[2:]) if self.chat else got
        args = keyword_arguments(got[0], self.keyword_tools[got[0]], got[1])
        return args if isinstance(args, str) else (got[0], args, *got[2:])

    @property
    def tool_counts(self) -> dict[str, int]:
        """Calls by outcome (``sandbox.STATUSES``), for the generation's stats."""
        return dict(self.counts)


def _checked(where: str, tools: Any, call_format: Any, result_format: Any, limits: Any,
             call_reward: Any, max_calls: Any = 8) -> tuple[dict[str, str], ToolLimits]:
    """The tools (name -> "module:function") and limits of a ToolEnv, or one ValueError naming ``where``."""
    if call_format not in FORMATS:
        raise ValueError(f"{where}: call_format must be one of {', '.join(FORMATS)}, got {call_format!r}")
    if isinstance(tools, str) or not isinstance(tools, (Mapping, list, tuple, set, frozenset)) or not tools:
        raise ValueError(f"{where}: tools must be a list of built-in names ({', '.join(BUILTIN_TOOLS)}) or a "
                         f"dict name -> 'module:function', or tools declared with realloc.tools.declared.tool(...)")
    named = {t: t for t in tools} if not isinstance(tools, Mapping) else dict(tools)
    out: dict[str, str] = {}
    for name, fn in named.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{where}: tool name {name!r} must be an identifier (it is written as <{name}>)")
        fn = BUILTIN_TOOLS.get(fn, fn)
        if not isinstance(fn, str) or ":" not in fn:
            raise ValueError(f"{where}: tool {name!r} must be a built-in name ({', '.join(BUILTIN_TOOLS)}) or "
                             f"'module:function' (it runs in a fresh process, so it is named, not passed)")
        out[name] = fn
    if not isinstance(result_format, str) or "{}" not in result_format:
        raise ValueError(f"{where}: result_format must contain {{}} where the tool's answer goes")
    try:  # str.format at the first tool call: other braces ('{"result": "{}"}') raised KeyError mid-run
        result_format.format("")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{where}: result_format {result_format!r} cannot be filled in ({type(e).__name__}: {e}); "
                         f"give it one {{}} where the answer goes and write other braces doubled, "
                         f"{{{{ and }}}}") from None
    if isinstance(call_reward, bool) or not isinstance(call_reward, (int, float)) or not math.isfinite(call_reward):
        raise ValueError(f"{where}: call_reward must be a finite number, got {call_reward!r}")
    if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
        raise ValueError(f"{where}: max_calls must be a positive integer (tool calls run in one turn), got "
                         f"{max_calls!r}")
    return out, ToolLimits.of(where, limits)


def check_env_args(call: str, env_args: Mapping[str, Any]) -> None:
    """What ``ToolEnv(**env_args)`` refuses, checked when the graph is built (``realloc show``) rather than in the
    workers mid-run: torch-free and starting nothing (the chat template renders when the environment is made), a
    tool module that cannot be found included (it is looked up, not imported)."""
    where = f"call {call!r}: interface_args['env_args'] of env 'tools'"
    params = inspect.signature(ToolEnv.__init__).parameters
    unknown = sorted(set(env_args) - set(params) - {"self"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(p for p in params if p != 'self')}")
    a = {p: v.default for p, v in params.items() if p != "self"} | dict(env_args)
    a["tools"], _ = env_tools(where, a["tools"])
    tools, _ = _checked(where, a["tools"], a["call_format"], a["result_format"], a["limits"], a["call_reward"],
                        a["max_calls"])
    if a["call_format"] == "chat" and a["chat_template"] is not None:  # renders the template; loads no tokenizer
        chat_format(where, a["chat_template"], a["end_of_turn"])
    rule = a["rule"]
    if not (rule == "exact_match" or callable(rule) or (isinstance(rule, str) and ":" in rule)):
        raise ValueError(f"{where}: rule must be 'exact_match', a function or 'module:function', got {rule!r}")
    for name, fn in tools.items():
        module = fn.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"{where}: tool {name!r} names {fn!r}, but module {module!r} cannot be found on this "
                             f"Python path; put it on PYTHONPATH or next to the experiment")


def _rule(rule: Any) -> Any:
    if rule == "exact_match":
        from realloc.algorithms.rewards.text_rules import exact_number_match

        return exact_number_match
    return resolve_function("ToolEnv", rule, "rule")
