"""Verifiable rewards: score a decoded response against the dataset record's reference answer.

    exact_number_match("23+9=", "32<|eos|>", "32")   # 1.0
    exact_number_match("23+9=", " 31 ", "32")        # 0.0

A rule here is a plain function ``(prompt_text, response_text, answer) -> float`` of text, so it does
not depend on a tokenizer; the rule-reward interface decodes the response and looks the answer up in
the prompt's dataset record.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> str | None:
    """The first integer written in ``text`` (an optional minus sign and digits), or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def exact_number_match(prompt_text: str, response_text: str, answer: str) -> float:
    """1.0 when the response's first number is exactly ``answer``, else 0.0.

    Anything after that number (EOS or other special tokens left in by decoding, whitespace, more text)
    is ignored, as is whitespace around the answer. The comparison is of the digits as written: "032"
    does not match "32", so the policy is rewarded only for the canonical form the task asks for.
    """
    got = first_number(response_text)
    return float(got is not None and got == str(answer).strip())
