"""Rewards computed from text: a rule scores the decoded prompt and response against a field of the prompt's
dataset record (the ``verifiable_reward`` interface)::

    ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule", interface_type=INFERENCE,
                         interface_impl="verifiable_reward", input_data=["seq"], output_data=["rewards"],
                         interface_args={"rule": "exact_match", "field": "answer"})

``rule`` is a built-in name or a function of the experiment file ``rule(prompt, response, answer) -> float``
(workers import the experiment file themselves; nothing executable crosses the wire). ``field`` (default
``answer``) names the record's column with the reference.

The built-in rule, ``exact_match``, scores a decoded response against the record's reference answer:

    exact_number_match("23+9=", "32<|eos|>", "32")   # 1.0
    exact_number_match("23+9=", " 31 ", "32")        # 0.0

A rule here is a plain function of text, so it does not depend on a tokenizer; the interface
(``rule_reward.verifiable_scores``) decodes the response and looks the answer up in the prompt's dataset record.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

TextRule = Callable[[str, str, str], float]

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


def _builtin_rules() -> dict[str, TextRule]:
    return {"exact_match": exact_number_match}


def resolve_text_rule(call: str, args: Mapping[str, Any]) -> tuple[TextRule, str]:
    """The rule function of call ``call`` and the record field it compares against."""
    rule = args.get("rule")
    field = args.get("field", "answer")
    if not isinstance(field, str) or not field:
        raise ValueError(f"call {call!r}: interface_args['field'] must name the record's reference column")
    if callable(rule):
        return rule, field
    builtins = _builtin_rules()
    if rule not in builtins:
        raise ValueError(f"call {call!r}: verifiable_reward needs interface_args['rule']: one of "
                         f"{', '.join(sorted(builtins))}, or a function (prompt, response, answer) -> float of the "
                         f"experiment file; got {rule!r}")
    return builtins[rule], field
