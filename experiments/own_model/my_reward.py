"""The reward of the own-model recipe (docs/recipe-own-model-grpo.md): one plain function, used in-process by
``grpo.py`` and served over HTTP by ``reward_server.py``, so both give the same scores.

``score(prompts, responses, records)`` gets this dp rank's decoded prompt and response texts and each prompt's
dataset record (its fields besides the prompt, here ``"answer"``), and returns one number per response.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

_WORD = re.compile(r"\w+")


def score(prompts: Sequence[str], responses: Sequence[str], records: Sequence[dict[str, Any]]) -> list[float]:
    """1 for a response whose words include the record's answer ("11", "the forest"); otherwise a little credit,
    0.2 x the share of the response's words that occur in the prompt (an on-topic answer), so that a model that
    never hits the answer still gets a signal. An empty response scores 0."""
    out = []
    for prompt, response, record in zip(prompts, responses, records):
        words = _WORD.findall(response.lower())
        answer = " ".join(_WORD.findall(str(record["answer"]).lower()))
        if answer and answer in " ".join(words):
            out.append(1.0)
            continue
        seen = set(_WORD.findall(prompt.lower()))
        out.append(0.2 * sum(w in seen for w in words) / len(words) if words else 0.0)
    return out
