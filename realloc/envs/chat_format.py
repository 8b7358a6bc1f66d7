"""How a chat template writes a tool call, learned from the template itself (``ToolEnv(call_format="chat")``).

Chat models call tools in their own formats, and their chat templates write them (``apply_chat_template(...,
tools=...)`` of an assistant message with ``tool_calls``):

- Qwen2, Qwen3, Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- Llama 3.1 / 3.2: the JSON object alone, ``{"name": ..., "parameters": {...}}`` (a model may write
  ``<|python_tag|>`` before it), the tool's answer in the ``ipython`` role;
- Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]``, answers as ``[TOOL_RESULTS]`` with the
  call's id.

``chat_format`` renders a known call (a probe tool with one string argument, followed by the tool's answer) and
reads off the text before the call's JSON, the text after it up to the end of the turn, whether the calls are a
JSON list, the key of the arguments and the key of the call's id. The policy's turn reaches the environment
decoded without special tokens, so the tokenizer's special tokens (from the tokenizer directory's files) are
taken out of that text as decoding takes them out of the turn: Mistral's ``[TOOL_CALLS]`` leaves nothing, Qwen's
``<tool_call>`` (an ordinary added token) stays. ``ChatFormat.parse_calls`` then finds every call of a turn
(models such as Qwen2.5, Qwen3, Llama 3.1 and Mistral write several in one turn), ``parse`` the first.

A template that writes tool messages but no tool calls (a plain ChatML template, such as the tiny test tokenizer's)
reads calls in the Hermes format above, as ``call_format="chat"`` always did. A template that cannot write a tool
message at all is one ValueError naming it and ``call_format``, raised when the environment is checked
(``realloc show``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

from realloc.tools.keywords import json_object

# the probe call: names and values no template writes on its own
PROBE_TOOL, PROBE_ARG, PROBE_VALUE, PROBE_ID = "probe_tool_x7", "probe_arg", "probe value 7x", "probe0000"
PROBE = {"name": PROBE_TOOL, "arguments": {PROBE_ARG: PROBE_VALUE}}
PROBE_SCHEMA = {"type": "function", "function": {
    "name": PROBE_TOOL, "description": "A tool.",
    "parameters": {"type": "object", "properties": {PROBE_ARG: {"type": "string", "description": "Its input."}},
                   "required": [PROBE_ARG]}}}
RESULT = "probe result 9q"
# Stands for the policy's turn while the template renders around it (not text a tokenizer would produce).
TURN = "\x00policy turn\x00"
CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A tool call as a template writes it and as the policy's decoded turn shows it."""

    prefix: str = "<tool_call>"  # before the call's JSON ("" for none), special tokens taken out
    suffix: str = "</tool_call>"  # after it, before the end of the turn ("" for none)
    arguments: str = "arguments"  # the key of the call's arguments ("parameters": Llama 3)
    name: str = "name"  # the key of the tool's name
    listed: bool = False  # the calls are a JSON list (Mistral)
    id_key: str | None = None  # the key of the call's id, where the template writes one
    specials: tuple[str, ...] = ()  # the tokenizer's special tokens, which decoding drops from the turn
    raw_prefix: str = ""  # the prefix as the template writes it, special tokens included

    def parse(self, text: str, names: Any) -> tuple[str, str, str | None] | str | None:
        """The first call of a turn: (tool name, its input, the call's id or None), an error message the policy
        should see when the call is malformed or names no tool of the environment, or None for a turn without a
        call (its final answer)."""
        got = self.parse_arguments(text, names)
        return (got[0], tool_input(got[1]), got[2]) if isinstance(got, tuple) else got

    def parse_arguments(self, text: str, names: Any) -> tuple[str, Any, str | None] | str | None:
        """As ``parse``, with the call's arguments as written (a JSON value; None where it writes none), for a tool
        called with keywords."""
        calls = self.parse_calls(text, names)
        return calls[0] if calls else None

    def parse_calls(self, text: str, names: Any) -> list[tuple[str, Any, str | None] | str] | None:
        """Every call of a turn, in order (parallel calls: Qwen's several ``<tool_call>`` blocks, Mistral's list,
        Llama's JSON objects one after another), each as ``parse_arguments`` gives one or as an error message the
        policy should see; None for a turn without a call (its final answer)."""
        for token in self.specials:
            text = text.replace(token, "")
        decoder = json.JSONDecoder()
        calls: list[tuple[str, Any, str | None] | str] = []
        if self.prefix and self.suffix and not self.listed:  # Hermes: the JSON after each opening tag
            # decoded from the tag on, not cut at the first closing tag: an argument may hold "</tool_call>", and a
            # whole call whose closing tag the policy left out (it ended its turn right after the JSON) is a call
            at = text.find(self.prefix)
            while at >= 0:
                start = len(text) - len(text[at + len(self.prefix):].lstrip())
                try:
                    value, end = decoder.raw_decode(text, start)
                except json.JSONDecodeError as e:
                    close = text.find(self.suffix, start)
                    if close < 0:  # the tag, then no call and no closing tag: text (a final answer, if the first)
                        break
                    calls.append(f"error: the tool call is not JSON ({e.msg})")
                    end = close + len(self.suffix)
                else:
                    calls.append(self._call(value, names))
                at = text.find(self.prefix, end)
            return calls or None
        start = self._start(text)
        if start is None:
            return None
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as e:
            return [f"error: the tool call is not JSON ({e.msg})"]
        if self.listed:
            return [self._call(v, names) for v in value] if isinstance(value, list) and value else \
                [self._call(value, names)]
        calls.append(self._call(value, names))
        while True:  # bare JSON objects (Llama 3): the next call right after this one, past spaces and a ; or ,
            i = end
            while i < len(text) and (text[i].isspace() or text[i] in ";,"):
                i += 1
            if i >= len(text) or text[i] != "{":
                return calls  # text after the calls is ignored
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return calls
            if not isinstance(value, dict) or self.name not in value:
                return calls
            calls.append(self._call(value, names))

    def _call(self, call: Any, names: Any) -> tuple[str, Any, str | None] | str:
        """One call's JSON value as (tool name, its arguments as written, the call's id or None), or an error."""
        if not isinstance(call, dict) or not isinstance(call.get(self.name), str):
            return f'error: a tool call is {"[" if self.listed else ""}{{"{self.name}": ..., "{self.arguments}": ' \
                   f'...}}{"]" if self.listed else ""}'
        tool = call[self.name]
        if tool not in names:
            return f"error: no tool {tool!r}; tools: {', '.join(sorted(names))}"
        args = call.get(self.arguments, call.get("arguments", call.get("parameters")))  # None: none written
        ident = call.get(self.id_key) if self.id_key else None
        return tool, args, ident if isinstance(ident, str) and CALL_ID.fullmatch(ident) else None

    def _start(self, text: str) -> int | None:
        """Where the call's JSON starts: after the prefix, or at the start of the turn (no prefix, or one that
        decoding may have dropped: a template given as text alone does not say which tokens are special)."""
        i = text.find(self.prefix) if self.prefix else -1
        if i >= 0:
            i += len(self.prefix)
        else:
            i = len(text) - len(text.lstrip())
            raw = self.raw_prefix.strip()
            if raw and text.startswith(raw, i):  # the turn as the template writes it, special tokens kept
                i += len(raw)
        while i < len(text) and text[i].isspace():
            i += 1
        # a list only where the template writes one, so that a Llama 3 answer such as "[1, 2]" is no call
        return i if i < len(text) and text[i] in ("{[" if self.listed else "{") else None


HERMES = ChatFormat()


def tool_input(arguments: Any) -> str:
    """The tool's one string from a call's arguments: a string as it is, an object with one value as that value,
    none (None) as "", anything else as its JSON text. A string holding a JSON object (OpenAI's
    ``"arguments": "{\\"expression\\": \\"2*3\\"}"``) is that object, as a tool called with keywords reads it
    (``tools/keywords.py``)."""
    if isinstance(arguments, str):
        decoded = json_object(arguments)
        if decoded is None:
            return arguments
        arguments = decoded
    if arguments is None:  # a call that writes no arguments
        return ""
    if isinstance(arguments, dict) and len(arguments) == 1:
        (value,) = arguments.values()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    return json.dumps(arguments)


@dataclasses.dataclass(frozen=True)
class Template:
    """A chat template with what ``apply_chat_template`` passes it: the tokenizer's named special tokens, and the
    texts of all its special tokens (which decoding drops)."""

    text: str
    name: str  # the tokenizer directory, or "the template text"
    named: tuple[tuple[str, str], ...] = ()
    specials: tuple[str, ...] = ()

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, eos: str | None = None) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        kwargs = dict(self.named) if self.named else {"bos_token": "", "eos_token": eos or "<|im_end|>"}
        (text,), _ = render_jinja_template(conversations=[messages], tools=[PROBE_SCHEMA], chat_template=self.text,
                                           add_generation_prompt=generation_prompt, **kwargs)
        return text


def is_text(spec: str) -> bool:
    """A template's Jinja text rather than a tokenizer directory."""
    return "{%" in spec or "{{" in spec


def load_template(spec: str) -> Template:
    """A chat template: a tokenizer directory's (``chat_template.jinja`` or ``tokenizer_config.json``), with its
    special tokens, or the template text itself (anything with a Jinja tag)."""
    if is_text(spec):
        return Template(spec, "the template text")
    root = Path(spec).expanduser()
    cfg_file = root / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    text = _template_text(root, cfg)
    if not text:
        raise ValueError(f"chat_template {spec!r} is neither a Jinja template nor a tokenizer directory with "
                         f"one (chat_template.jinja, or chat_template in tokenizer_config.json)")
    named = _named_tokens(root, cfg)
    added = [t for t in cfg.get("added_tokens_decoder", {}).values() if isinstance(t, dict)]
    if not added and (root / "tokenizer.json").is_file():
        added = json.loads((root / "tokenizer.json").read_text()).get("added_tokens", [])
    specials = {t.get("content") for t in added if t.get("special")} | set(named.values())
    # longest first, so that a token that contains another is taken out whole
    ordered = tuple(sorted((s for s in specials if isinstance(s, str) and s.strip()), key=lambda s: (-len(s), s)))
    return Template(text, str(root), tuple(sorted(named.items())), ordered)


def _template_text(root: Path, cfg: dict[str, Any]) -> str | None:
    """The template ``apply_chat_template(..., tools=...)`` uses: a ``tool_use`` template where the tokenizer has
    named ones (``additional_chat_templates/``, or a list in ``tokenizer_config.json``), else the default."""
    for f in (root / "additional_chat_templates" / "tool_use.jinja", root / "chat_template.jinja"):
        if f.is_file():
            return f.read_text()
    text = cfg.get("chat_template")
    if isinstance(text, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("tool_use", named.get("default"))
    return text if isinstance(text, str) and text else None


def _named_tokens(root: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as ``apply_chat_template`` passes them (``special_tokens_map.json`` first)."""
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    found = dict(cfg)
    extra = root / "special_tokens_map.json"
    if extra.is_file():
        found.update(json.loads(extra.read_text()))
    out = {}
    for key in names:
        v = found.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[key] = v
    return out


def chat_format(where: str, spec: str, end_of_turn: str | None) -> tuple[Template, ChatFormat, str]:
    """The template, its tool-call format and the end-of-turn token the policy generates (``end_of_turn`` if
    given); one ValueError naming ``where``, the template and ``call_format`` when the template cannot write a
    tool message."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{where}: chat_template must be a tokenizer directory or a Jinja template's text, "
                         f"got {spec!r}")
    if end_of_turn is not None and (not isinstance(end_of_turn, str) or not end_of_turn):
        raise ValueError(f"{where}: end_of_turn must be the token that ends the policy's turn (a string), or None to "
                         f"read it from the template, got {end_of_turn!r}")
    root = Path(spec).expanduser()
    try:
        stamp = () if is_text(spec) else tuple(f.stat().st_mtime_ns if f.is_file() else 0 for f in (
            root / "chat_template.jinja", root / "tokenizer_config.json", root / "tokenizer.json"))
        return _learned(spec, end_of_turn, stamp)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read chat_template {spec!r}: {e}") from None


@functools.lru_cache(maxsize=16)  # pure for a template's files (their mtimes are in the key); one ToolEnv a rollout
def _learned(spec: str, end_of_turn: str | None, stamp: tuple[int, ...]) -> tuple[Template, ChatFormat, str]:
    del stamp
    template = load_template(spec)

    def render(messages: list[dict[str, Any]], generation_prompt: bool, what: str) -> str:
        try:
            return template.render(messages, generation_prompt, end_of_turn)
        except Exception as e:  # noqa: BLE001  (a template's raise_exception, an undefined name, ...)
            raise ValueError(f"call_format 'chat' needs a chat template that writes tool calls and tool messages; "
                             f"the template of {template.name} fails on {what} ({type(e).__name__}: {e}); use a "
                             f"tokenizer whose template supports tools, or call_format 'tags'") from None

    user = {"role": "user", "content": "?"}
    eot = end_of_turn
    if eot is None:  # what the template writes after an assistant turn starts with the token the policy ends it with
        after = render([user, {"role": "assistant", "content": TURN}], False, "an assistant turn").split(TURN, 1)[-1]
        eot = next((t for t in template.specials if after.startswith(t)), after.split()[0] if after.strip() else "")
    tool = {"role": "tool", "content": RESULT, "name": PROBE_TOOL, "tool_call_id": PROBE_ID}
    answered = render([user, {"role": "assistant", "content": TURN}, tool], True, "a tool message")
    if RESULT not in answered.split(TURN, 1)[-1]:
        raise ValueError(f"call_format 'chat' needs a chat template that writes tool messages; the template of "
                         f"{template.name} writes nothing for one; use a tokenizer whose template supports tools, "
                         f"or call_format 'tags'")
    called = render([user, {"role": "assistant", "content": "", "tool_calls": [
        {"id": PROBE_ID, "type": "function", "function": PROBE}]}, tool], True, "an assistant turn with a tool call")
    return template, _format_of(template, render([user], True, "a user turn"), called, eot), eot


def _format_of(template: Template, prompt: str, called: str, eot: str) -> ChatFormat:
    """The call format in ``called`` (the probe call rendered after ``prompt``); Hermes when the template writes no
    tool calls; one ValueError when it writes them other than as a JSON object with the tool's name."""
    turn = called[_turn_start(template, prompt, called):]
    if PROBE_TOOL not in turn:  # the template writes no tool calls: Hermes, as call_format "chat" always read
        return HERMES
    found = _probe_json(turn)
    if found is None:
        shown = turn[:turn.find(PROBE_TOOL) + 200]
        raise ValueError(f"call_format 'chat' reads tool calls written as JSON objects with the tool's name; the "
                         f"template of {template.name} writes one as {shown!r}; use call_format 'tags', or a "
                         f"tool-calling environment of your own")
    start, end, value = found
    call = value[0] if isinstance(value, list) else value
    name = next(k for k, v in call.items() if v == PROBE_TOOL)
    args = next((k for k, v in call.items() if k != name and _is_probe_args(v)), "arguments")
    id_key = next((k for k, v in call.items() if v == PROBE_ID), None)
    rest = turn[end:]
    suffix = rest[:rest.find(eot)] if eot and eot in rest else ""

    def visible(s: str) -> str:
        for token in template.specials:
            s = s.replace(token, "")
        return s.strip()

    return ChatFormat(prefix=visible(turn[:start]), suffix=visible(suffix), arguments=args, name=name,
                      listed=isinstance(value, list), id_key=id_key, specials=template.specials,
                      raw_prefix=turn[:start].strip())


def _turn_start(template: Template, prompt: str, called: str) -> int:
    """Where the assistant turn starts in ``called``: after the prompt, or, where the generation prompt adds more
    than the template writes before an earlier assistant turn (an empty think block, say), after the last
    whitespace or special token the two renderings share (not inside a tag both happen to start alike)."""
    if called.startswith(prompt):
        return len(prompt)
    i = len(os.path.commonprefix([prompt, called]))
    while i > 0 and not called[i - 1].isspace() and not any(called.endswith(t, 0, i) for t in template.specials):
        i -= 1
    return i


def _probe_json(turn: str) -> tuple[int, int, Any] | None:
    """(start, end, value) of the JSON that holds the probe call: its object, or the list around it."""
    at = turn.find(PROBE_TOOL)
    decoder = json.JSONDecoder()
    for i in range(at, -1, -1) if at >= 0 else ():
        if turn[i] != "{":
            continue
        try:
            value, end = decoder.raw_decode(turn, i)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and PROBE_TOOL in value.values() and end > at:
            j = i
            while j > 0 and turn[j - 1].isspace():
                j -= 1
            if j > 0 and turn[j - 1] == "[":
                try:
                    outer, outer_end = decoder.raw_decode(turn, j - 1)
                    if isinstance(outer, list) and outer and outer[0] == value:
                        return j - 1, outer_end, outer
                except json.JSONDecodeError:
                    pass
            return i, end, value
    return None


def _is_probe_args(v: Any) -> bool:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            return False
    return v == PROBE["arguments"]
