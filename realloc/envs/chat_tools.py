"""Tool calls in a chat model's own format (``ToolEnv(call_format="chat")``, docs/multi-turn.md).

Chat models of the Qwen2 and Hermes families write a tool call as JSON between ``<tool_call>`` tags::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*45"}}
    </tool_call>

and read the tool's answer as a message of the ``tool`` role, which their chat template renders (Qwen2's: as a
user turn holding ``<tool_response>...</tool_response>``). ``parse_tool_call`` finds the first call of a turn;
``ChatObservation`` renders a tool's answer with the template: the text the template writes after the policy's
turn (past the end-of-turn token the policy itself generated) up to and including the next assistant turn's
generation prompt, so the conversation the policy continues is exactly the one the template would write.

A tool is a function of one string (``tools/sandbox.py``); the call's ``arguments`` become that string: a string
as it is, an object with one value as that value, anything else as its JSON text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Stands for the policy's turn while the template renders around it (not text a tokenizer would produce).
_TURN = "\x00policy turn\x00"


def tool_input(arguments: Any) -> str:
    """The tool's one string from a call's ``arguments`` (the module docstring's rule)."""
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict) and len(arguments) == 1:
        (value,) = arguments.values()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    return json.dumps(arguments)


def parse_tool_call(text: str, names: Any) -> tuple[str, str] | str | None:
    """The first ``<tool_call>`` of a turn: (tool name, its input), an error message the policy should see when the
    call is malformed or names no tool of the environment, or None for a turn without a call (its final answer)."""
    m = TOOL_CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        return f"error: the tool call is not JSON ({e.msg})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'error: a tool call is {"name": ..., "arguments": ...}'
    if call["name"] not in names:
        return f"error: no tool {call['name']!r}; tools: {', '.join(sorted(names))}"
    return call["name"], tool_input(call.get("arguments", ""))


def load_template(where: str, spec: str) -> str:
    """A chat template: a tokenizer directory's (``chat_template.jinja`` or ``tokenizer_config.json``), or the
    template text itself (anything with a Jinja tag)."""
    if "{%" in spec or "{{" in spec:
        return spec
    root = Path(spec).expanduser()
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    cfg = root / "tokenizer_config.json"
    if cfg.is_file():
        template = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(template, str) and template:
            return template
    raise ValueError(f"{where}: chat_template {spec!r} is neither a Jinja template nor a tokenizer directory with "
                     f"one (chat_template.jinja, or chat_template in tokenizer_config.json)")


class ChatObservation:
    """Renders a tool's answer as the chat template writes a ``tool`` message, with the next turn's prompt."""

    def __init__(self, where: str, template: str, end_of_turn: str = "<|im_end|>") -> None:
        from transformers.utils.chat_template_utils import render_jinja_template

        self.template, self.end_of_turn = load_template(where, template), end_of_turn
        self._render = render_jinja_template
        probe = self.observation("0")
        if not probe:
            raise ValueError(f"{where}: the chat template writes nothing for a tool message")

    def observation(self, result: str) -> str:
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN},
                    {"role": "tool", "content": result}]
        (text,), _ = self._render(conversations=[messages], chat_template=self.template, add_generation_prompt=True,
                                  bos_token="", eos_token=self.end_of_turn)
        tail = text.split(_TURN, 1)[1]
        # the policy's turn ended with the end-of-turn token it generated (EOS): the observation starts after it
        return tail[len(self.end_of_turn):] if tail.startswith(self.end_of_turn) else tail
