"""Rule-based rewards: parameter-free functions of token ids (model_type "rule", interface_impl "rule_reward"), and
the interface functions of both rule rewards (``rule_scores``; ``verifiable_scores``, whose rules on decoded text are
in ``text_rules.py``).

A call selects its rule through ``interface_args``::

    ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule", interface_type=INFERENCE,
                         interface_impl="rule_reward", input_data=["seq"], output_data=["rewards"],
                         interface_args={"rule": "token_set", "tokens": list(range(16, 32))})

``rule`` is the name of a built-in rule below, or a callable defined in the experiment file
(workers import the experiment file themselves, so nothing executable crosses the wire). Every
rule maps ``(prompt_tokens [n, P], response_tokens [n, T], response_mask [n, T] bool, **args)``
to one float score per sequence.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from realloc.algorithms.common import response_columns, score_result
from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.algorithms.rewards.text_rules import resolve_text_rule

RuleFn = Callable[..., torch.Tensor]


def token_set_fraction(prompt_tokens: torch.Tensor, response_tokens: torch.Tensor, response_mask: torch.Tensor,
                       tokens: list[int]) -> torch.Tensor:
    """Fraction of valid response tokens that belong to ``tokens``; 0 for an empty response.

    Under a uniform policy the expected score is ``len(tokens) / vocab_size``; a policy that
    learned the task scores 1.
    """
    target = torch.as_tensor(sorted(set(int(t) for t in tokens)), dtype=response_tokens.dtype)
    hit = torch.isin(response_tokens, target) & response_mask
    n = response_mask.sum(dim=1)
    return torch.where(n > 0, hit.sum(dim=1).float() / n.clamp(min=1).float(), torch.zeros(n.shape))


BUILTIN_RULES: Mapping[str, RuleFn] = {"token_set": token_set_fraction}


def resolve_rule(call: str, args: Mapping[str, Any]) -> tuple[RuleFn, dict[str, Any]]:
    """The rule function of call ``call`` and the keyword arguments it gets."""
    kwargs = dict(args)
    rule = kwargs.pop("rule", None)
    if rule is None:
        raise ValueError(f"call {call!r}: a rule_reward call needs interface_args['rule'], e.g. 'token_set' "
                         f"(built-in rules: {', '.join(BUILTIN_RULES)}) or a function of the experiment file")
    if callable(rule):
        return rule, kwargs
    if rule not in BUILTIN_RULES:
        raise ValueError(f"call {call!r}: unknown rule {rule!r}; built-in rules: {', '.join(BUILTIN_RULES)}")
    if rule == "token_set":
        toks = kwargs.get("tokens")
        if not isinstance(toks, (list, tuple)) or not toks or not all(isinstance(t, int) for t in toks):
            raise ValueError(f"call {call!r}: rule 'token_set' needs interface_args['tokens'], a non-empty list of "
                             f"token ids")
    return BUILTIN_RULES[rule], kwargs


def score(call: str, args: Mapping[str, Any], prompt_tokens: torch.Tensor, response_tokens: torch.Tensor,
          response_mask: torch.Tensor) -> torch.Tensor:
    fn, kwargs = resolve_rule(call, args)
    out = torch.as_tensor(fn(prompt_tokens, response_tokens, response_mask, **kwargs), dtype=torch.float32)
    if out.shape != (response_tokens.shape[0],):
        raise ValueError(f"call {call!r}: the reward rule returned shape {tuple(out.shape)}, expected one score per "
                         f"sequence ({response_tokens.shape[0]},)")
    return out


def split_prompt_response(seq: Mapping[str, torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens [n, P] right-padded, response tokens [n, T] aligned with gen_mask; pad elsewhere)."""
    tokens, plen, mask = seq["tokens"], seq["prompt_lens"], seq["gen_mask"]
    P = tokens.shape[1] - mask.shape[1]
    prompt_mask = torch.arange(P).view(1, P) < plen.view(-1, 1)
    prompt = torch.where(prompt_mask, tokens[:, :P], torch.full_like(tokens[:, :P], pad_token_id))
    response = torch.where(mask, response_columns(tokens, plen, mask), torch.full_like(mask, pad_token_id,
                                                                                       dtype=tokens.dtype))
    return prompt, response


def rule_scores(ctx: CallContext, inputs: Data) -> CallResult:
    seq = inputs["seq"]
    prompt, response = split_prompt_response(seq, ctx.pad_token_id)
    return score_result(score(ctx.call.name, ctx.call.interface_args, prompt, response, seq["gen_mask"]))


def verifiable_scores(ctx: CallContext, inputs: Data) -> CallResult:
    """A rule on the decoded prompt and response and the prompt's dataset record (``interface_args``: ``rule``,
    a built-in name or a function of the experiment file, and ``field``, the record's reference answer)."""
    seq = inputs["seq"]
    if ctx.tokenizer is None or ctx.records is None:
        raise ValueError(f"call {ctx.call.name!r}: verifiable_reward decodes text and reads each prompt's dataset "
                         f"record; the experiment needs a tokenizer and a prompt dataset")
    rule, field = resolve_text_rule(ctx.call.name, ctx.call.interface_args)
    # One host copy of each column, and each distinct token sequence decoded once: a group's n samples share
    # their prompt and, on a short answer, often their response (decoding is a pure function of the ids).
    tokens, plens = seq["tokens"].tolist(), seq["prompt_lens"].tolist()
    lens, rows = seq["gen_mask"].sum(dim=1).tolist(), seq["rows"].tolist()
    texts: dict[tuple[int, ...], str] = {}
    records: dict[int, Mapping[str, Any]] = {}

    def decode(ids: list[int]) -> str:
        key = tuple(ids)
        if key not in texts:
            texts[key] = ctx.tokenizer.decode(ids, skip_special_tokens=True)
        return texts[key]

    scores = []
    for b, ids in enumerate(tokens):
        plen, n = plens[b], lens[b]
        prompt, response = decode(ids[:plen]), decode(ids[plen:plen + n])
        record = records[rows[b]] if rows[b] in records else records.setdefault(rows[b], ctx.records(rows[b]))
        if field not in record:
            raise ValueError(f"call {ctx.call.name!r}: the prompt record has no field {field!r} (it has "
                             f"{', '.join(sorted(record)) or 'none'}); set interface_args['field']")
        scores.append(float(rule(prompt, response, str(record[field]))))
    return score_result(torch.tensor(scores, dtype=torch.float32))
