"""How dataset records (prompts, SFT pairs, preference pairs) become token ids (torch-free, so experiment
files can import it cheaply).

    from realloc.data import DataConfig
    DataConfig(overflow="drop", use_chat_template=True)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

_KEYS = ("prompt_key", "messages_key", "response_key", "chosen_key", "rejected_key")
_CHOICES = {"overflow": ("truncate", "drop"), "truncation_side": ("left", "right")}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    prompt_key: str = "prompt"  # column with the prompt text, or a list of token ids
    messages_key: str = "messages"  # column with chat messages [{"role": ..., "content": ...}, ...]
    response_key: str = "response"  # SFT: the response text or token ids
    chosen_key: str = "chosen"  # preference pairs: the preferred response
    rejected_key: str = "rejected"  # preference pairs: the other response
    # What happens to prompts longer than prompt_len and responses longer than gen_len. A truncated
    # response keeps its beginning.
    overflow: Literal["truncate", "drop"] = "truncate"
    # "left" keeps the end of a long prompt: the question and the chat template's generation prompt
    # are there. A leading BOS survives left truncation.
    truncation_side: Literal["left", "right"] = "left"
    add_special_tokens: bool = True  # e.g. BOS in front of plain-text prompts
    use_chat_template: bool = False  # render plain `prompt` strings as one user turn with the chat template
    # Tools the chat template presents to the policy: every chat prompt is rendered as
    # apply_chat_template(messages, tools=[...], add_generation_prompt=True). realloc.tools.declared.tool(...) each,
    # the same ones the rollout's ToolEnv runs (docs/multi-turn.md). Empty: rendered without tools, as before.
    tools: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for name in _KEYS:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"DataConfig.{name} must be a non-empty column name, got {value!r}")
            if value in seen:
                raise ValueError(f"DataConfig.{seen[value]} and DataConfig.{name} are both {value!r}; "
                                 f"they must name different columns")
            seen[value] = name
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"DataConfig.{name} must be one of {', '.join(map(repr, allowed))}, "
                                 f"got {getattr(self, name)!r}")
        for name in ("add_special_tokens", "use_chat_template"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DataConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.tools != ():
            from realloc.tools.declared import check_tools

            object.__setattr__(self, "tools", check_tools("DataConfig.tools", self.tools))
