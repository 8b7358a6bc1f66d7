"""Rewards users bring: a batched function of the decoded texts and the records, a remote reward service over
HTTP, and a weighted mix of reward keys (a rule and a reward model, say).

The reward contract (every reward call, these included): the call writes one finite score per sequence,
``{"rewards": {"score": [n]}}``; the framework makes the ``reward`` metrics from it (``context.reward_sums``).

``batch_reward``: ``interface_args={"fn": f, ...}`` with ``f(prompts, responses, records, **rest) -> [n] scores``
on this dp rank's sequences: the decoded prompt and response texts (token id lists without a tokenizer) and each
prompt's dataset record, all its other fields (``{"answer": "32", "data_source": "gsm8k", ...}``). The other
``interface_args`` are passed on as keywords. ``from_compute_score`` adapts verl's per-sample
``compute_score(data_source, solution_str, ground_truth, extra_info)``.

``remote_reward``: ``interface_args={"url": "http://host:port/score", ...}``; see ``remote_reward.py``.

``mix_rewards``: two reward keys in, ``sum_i weights[i] * score_i`` out (``interface_args={"weights": [a, b]}``);
chain two mixes for three.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.algorithms.rewards import reward_args

BatchRewardFn = Callable[..., Any]  # (prompts, responses, records, **kw) -> [n] scores


def texts(ctx: CallContext, seq: Mapping[str, torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """The decoded prompts and responses of ``seq``'s rows (token id lists when the run has no tokenizer)."""
    prompts, responses = [], []
    for b in range(seq["tokens"].shape[0]):
        plen, n = int(seq["prompt_lens"][b]), int(seq["gen_mask"][b].sum())
        p, r = seq["tokens"][b, :plen].tolist(), seq["tokens"][b, plen:plen + n].tolist()
        if ctx.tokenizer is not None:
            p = ctx.tokenizer.decode(p, skip_special_tokens=True)
            r = ctx.tokenizer.decode(r, skip_special_tokens=True)
        prompts.append(p)
        responses.append(r)
    return prompts, responses


def records_of(ctx: CallContext, seq: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Each row's dataset record (its fields besides the prompt), or {} per row without a dataset."""
    n = seq["tokens"].shape[0]
    if ctx.records is None or "rows" not in seq:
        return [{} for _ in range(n)]
    return [dict(ctx.records(int(r))) for r in seq["rows"]]


def as_scores(call: str, what: str, got: Any, n: int) -> torch.Tensor:
    """``got`` as one float32 score per sequence, or one ValueError naming the call and what returned it."""
    try:
        score = torch.as_tensor(got, dtype=torch.float32).reshape(-1) if not isinstance(got, torch.Tensor) \
            else got.detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"call {call!r}: {what} must return {n} numbers (one per sequence), got "
                         f"{type(got).__name__}: {e}") from None
    if score.dim() != 1 or score.shape[0] != n:
        raise ValueError(f"call {call!r}: {what} returned {tuple(score.shape)} scores for {n} sequences; return one "
                         f"number per sequence")
    return score


def batch_scores(ctx: CallContext, inputs: Data) -> CallResult:
    args = dict(ctx.call.interface_args)
    reward_args.check_batch(ctx.call.name, args)
    fn = args.pop("fn")
    seq = inputs["seq"]
    prompts, responses = texts(ctx, seq)
    got = fn(prompts, responses, records_of(ctx, seq), **args)
    name = getattr(fn, "__name__", "the reward function")
    return CallResult({"rewards": {"score": as_scores(ctx.call.name, name, got, len(prompts))}}, {}, {})


def from_compute_score(compute_score: Callable[..., Any], ground_truth: str = "ground_truth",
                       data_source: str = "data_source") -> BatchRewardFn:
    """A batched reward from verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
    extra_info)``: ``ground_truth`` and ``data_source`` name the record fields, ``extra_info`` is the record.
    A dict result (verl's ``{"score": ...}``) counts its ``score``."""
    def scores(prompts: Sequence[Any], responses: Sequence[Any], records: Sequence[dict]) -> list[float]:
        out = []
        for response, rec in zip(responses, records):
            if ground_truth not in rec:
                raise ValueError(f"compute_score: the prompt record has no field {ground_truth!r} (it has "
                                 f"{', '.join(sorted(rec)) or 'none'}); pass ground_truth='<field>'")
            s = compute_score(rec.get(data_source), response, rec[ground_truth], rec)
            out.append(float(s["score"] if isinstance(s, dict) else s))
        return out

    scores.__name__ = getattr(compute_score, "__name__", "compute_score")
    return scores


def remote_scores(ctx: CallContext, inputs: Data) -> CallResult:
    from realloc.algorithms.rewards.remote_reward import RemoteReward

    service = RemoteReward.of(ctx.call.name, ctx.call.interface_args)
    seq = inputs["seq"]
    prompts, responses = texts(ctx, seq)
    got = service.score(prompts, responses, records_of(ctx, seq))
    return CallResult({"rewards": {"score": as_scores(ctx.call.name, f"reward service {service.url}", got,
                                                      len(prompts))}}, {}, {})


def mix_scores(ctx: CallContext, inputs: Data) -> CallResult:
    args = ctx.call.interface_args
    reward_args.check_mix(ctx.call.name, args)
    a, b = inputs["rewards"]["score"].double(), inputs["other"]["score"].double()
    wa, wb = (float(x) for x in args["weights"])
    return CallResult({"rewards": {"score": (wa * a + wb * b).float()}}, {}, {})
