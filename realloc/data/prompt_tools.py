"""``DataConfig.tools``: the tools a chat template presents in every chat prompt (docs/multi-turn.md).

Prompts are rendered as ``apply_chat_template(messages, tools=[...], add_generation_prompt=True)`` with the
declared tools' JSON schemas (``realloc/tools/declared.py``), so the policy reads the tools as its template
presents them: Qwen's ``<tools>`` block in a system turn, Llama 3.1's JSON function list, Mistral's
``[AVAILABLE_TOOLS]``. A template that ignores ``tools=`` (renders the dataset's first chat prompt the same with and
without them) is refused: the policy would never see the tools the run declares for it. Describe them in a system
message of the prompts instead, and leave ``DataConfig.tools`` empty.
"""

from __future__ import annotations

from typing import Any

from realloc.data.config import DataConfig
from realloc.data.tokenizer import Tokenizer

PROBE = [{"role": "user", "content": "?"}]


def prompt_tools(cfg: DataConfig, tokenizer: Tokenizer, plain: str | None = None,
                 first: list[dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
    """The JSON schemas chat prompts are rendered with (None without ``DataConfig.tools``); one ValueError when the
    tokenizer's chat template does not show them in the dataset's ``first`` chat prompt (a one-question prompt
    without it: a template may write them in a system turn of its own only, and none where the prompts bring one),
    or when a prompt is plain text (``plain``: where), which shows none."""
    if not cfg.tools:
        return None
    from realloc.tools.declared import schemas

    if plain is not None:
        raise ValueError(f"DataConfig.tools: the prompt at {plain} is plain text, which shows the policy no tools; set "
                         f"DataConfig(use_chat_template=True) or give chat messages, so the template presents them")
    tools = schemas(cfg.tools)
    try:
        probe = first if first is not None else PROBE  # the dataset's own, where a chat prompt comes first
        with_tools, without = (tokenizer.encode_chat_batch([probe], tools=t)[0] for t in (tools, None))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001  (the template's raise_exception, an undefined name, ...)
        raise ValueError(f"DataConfig.tools: the chat template of tokenizer {tokenizer.path} fails with tools= "
                         f"({type(e).__name__}: {e})") from None
    if with_tools == without:
        raise ValueError(f"DataConfig.tools: the chat template of tokenizer {tokenizer.path} ignores tools= (it "
                         f"renders {'the first prompt' if first is not None else 'a prompt'} the same with and "
                         f"without them), so the policy would never see "
                         f"{', '.join(t.name for t in cfg.tools)}; use a tokenizer whose template presents tools, "
                         f"or describe them in a system message of the prompts and leave DataConfig.tools empty")
    return tools
