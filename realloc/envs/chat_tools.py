"""Tool calls in a chat model's own format (``ToolEnv(call_format="chat")``, docs/multi-turn.md).

Qwen2/Hermes models write a tool call as JSON between ``<tool_call>`` tags::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*45"}}
    </tool_call>

Llama 3 and Mistral write theirs otherwise; ``chat_format.py`` learns a template's own format by rendering a known
call, and Hermes is the format where no template is given or the template writes no tool calls.
``parse_tool_call`` finds the first Hermes call of a turn; ``ChatObservation`` renders a turn's tool answers (one
``tool`` message per call) with the template: the text the template writes after the policy's turn (past the end-of-turn token the policy itself
generated) up to and including the next assistant turn's generation prompt, so the conversation the policy
continues is exactly the one the template would write.

A tool is a function of one string (``tools/sandbox.py``); the call's arguments become that string: a string as it
is, an object with one value as that value, anything else as its JSON text (``chat_format.tool_input``).
"""

from __future__ import annotations

from typing import Any

from realloc.envs.chat_format import HERMES, TURN, chat_format, tool_input

__all__ = ["ChatObservation", "parse_tool_call", "tool_input"]


def parse_tool_call(text: str, names: Any) -> tuple[str, str] | str | None:
    """The first ``<tool_call>`` of a turn: (tool name, its input), an error message the policy should see when the
    call is malformed or names no tool of the environment, or None for a turn without a call (its final answer)."""
    got = HERMES.parse(text, names)
    return got[:2] if isinstance(got, tuple) else got


class ChatObservation:
    """A chat template's tool-call format, and a tool's answer rendered as the template writes a ``tool`` message,
    with the next turn's prompt."""

    def __init__(self, where: str, template: str, end_of_turn: str | None = None) -> None:
        self.where = where
        self.template, self.format, self.end_of_turn = chat_format(where, template, end_of_turn)
        self._calls = 0  # ids for calls the policy wrote without one (a template such as Mistral's renders ids)

    def observation(self, result: str, name: str | None = None, call_id: str | None = None) -> str:
        """The tool's answer ``result`` to the call of tool ``name`` with id ``call_id`` (the policy's own, if it
        wrote one; if the template refuses it, or without one, an id of the environment's)."""
        return self.observations([(result, name, call_id)])

    def observations(self, answers: list[tuple[str, str | None, str | None]]) -> str:
        """The answers (result, tool name, the call's id or None) to a turn's calls, in order: one ``tool`` message
        per call, rendered together, as the template writes several (Qwen's in one user turn, Llama's one
        ``ipython`` turn each, Mistral's ``[TOOL_RESULTS]`` one after another)."""
        tools = [{"role": "tool", "content": result, "name": name or "tool",
                  "tool_call_id": self._id(result, name, call_id)} for result, name, call_id in answers]
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN}, *tools]
        tail = self.template.render(messages, True, self.end_of_turn).split(TURN, 1)[1]
        # the policy's turn ended with the end-of-turn token it generated (EOS): the observation starts after it
        eot = self.end_of_turn
        return tail[len(eot):] if eot and tail.startswith(eot) else tail

    def _id(self, result: str, name: str | None, call_id: str | None) -> str:
        """The call's own id where the template takes it, else the next of the environment's."""
        self._calls += 1
        own = f"call{self._calls % 100000:05d}"  # 9 characters, as Mistral's templates ask of an id
        error: Exception | None = None
        for ident in ([call_id] if call_id is not None else []) + [own]:
            tool = {"role": "tool", "content": result, "name": name or "tool", "tool_call_id": ident}
            try:
                self.template.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN}, tool],
                                     True, self.end_of_turn)
            except Exception as e:  # noqa: BLE001  (a template's raise_exception on an id it does not take)
                error = e
                continue
            return ident
        raise ValueError(f"{self.where}: the chat template of {self.template.name} fails on a tool message "
                         f"({type(error).__name__}: {error})")
