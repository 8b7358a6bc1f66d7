"""Rewards computed from text: a rule scores the decoded prompt and response against a field of the prompt's
dataset record (the ``verifiable_reward`` interface)::

    ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule", interface_type=INFERENCE,
                         interface_impl="verifiable_reward", input_data=["seq"], output_data=["rewards"],
                         interface_args={"rule": "exact_match", "field": "answer"})

``rule`` is a built-in name or a function of the experiment file ``rule(prompt, response, answer) -> float``
(workers import the experiment file themselves; nothing executable crosses the wire). ``field`` (default
``answer``) names the record's column with the reference.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

TextRule = Callable[[str, str, str], float]


def _builtin_rules() -> dict[str, TextRule]:
    from realloc.algorithms.rewards.verifiable import exact_number_match

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
