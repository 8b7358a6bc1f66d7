"""Reward-model training (Bradley-Terry) on a ``ParallelModel`` with a scalar head (settings and declarations
in ``reward_model.py``).

A response's reward is the scalar head's output at the last token of prompt + response, as
``common.model_reward`` scores a PPO graph's sequences. The train step follows the layout-invariance rules
of ``supervised.py``: mini-batch k is the set of pairs whose global index is k mod M, the loss is divided by
the mini-batch's pair count all-reduced over dp, and a micro-batch holds the chosen and the rejected
responses of the same pairs (chosen rows first), since the loss needs both.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from realloc.algorithms.common import forward_batch, model_pad_id, scored_positions
from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.algorithms.pairs.reward_model import PAIR_SUMS, STATS
from realloc.algorithms.pairs.supervised import _both, pair_steps


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss ``-log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2`` from the rewards [n] of each
    pair's chosen and rejected response (InstructGPT eq. 1; the margin of Llama 2 eq. 1; the centring term of
    Eisenstein et al. 2023)."""
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def last_token_scores(values: torch.Tensor, seq: Mapping[str, torch.Tensor], pad_token_id: Any = None
                      ) -> torch.Tensor:
    """[n] the scalar head's output at the last token of each row (prompt + response) that is not the model's pad
    id (``common.scored_positions``)."""
    last = scored_positions(seq, pad_token_id)
    return values.gather(1, last.view(-1, 1).to(values.device)).squeeze(1)


def pair_margins(ctx: CallContext, pairs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[n] float64: the constant margin plus, with ``margin_field``, each pair's record value."""
    cfg = ctx.config
    n = pairs["prompt_lens"].shape[0]
    margin = torch.full((n,), float(cfg.margin), dtype=torch.float64)
    if cfg.margin_field is None:
        return margin
    if ctx.records is None or "rows" not in pairs:
        raise ValueError(f"call {ctx.call.name!r}: rm.margin_field={cfg.margin_field!r} reads each pair's dataset "
                         f"record, which this call does not get")
    for i, row in enumerate(pairs["rows"].tolist()):
        rec = ctx.records(int(row))
        value = rec.get(cfg.margin_field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"call {ctx.call.name!r}: rm.margin_field={cfg.margin_field!r}: dataset row {row} has "
                             f"{value!r}, not a finite number; give every record a numeric {cfg.margin_field!r} or "
                             f"set rm.margin_field=None")
        margin[i] += float(value)
    return margin


def _pair_sums(chosen: torch.Tensor, rejected: torch.Tensor, loss: torch.Tensor) -> dict[str, float]:
    c, r = chosen.detach().double(), rejected.detach().double()
    return {"rm_loss": float(loss.detach().double().sum()), "rm_accuracy": float((c > r).double().sum()),
            "rm_margin": float((c - r).sum()), "rm_chosen": float(c.sum()), "rm_rejected": float(r.sum())}


def rm_train(ctx: CallContext, inputs: Data) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None and ctx.optimizer is not None
    pairs = inputs["pairs"]
    margins = pair_margins(ctx, pairs)
    pad = model_pad_id(ctx)

    def bt_pair_loss(head: Any, m: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        scores = last_token_scores(head.values, m, pad)
        n = scores.shape[0] // 2
        chosen, rejected = scores[:n], scores[n:]
        per_pair = bradley_terry_loss(chosen, rejected, m["margin"].to(scores), cfg.center_coef)
        return per_pair, _pair_sums(chosen, rejected, per_pair)

    sums, grad_norm, lr0 = pair_steps(ctx, pairs, lambda r: {"margin": margins[r]}, bt_pair_loss, STATS)
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": grad_norm})
    return CallResult({}, sums, {"rm_grad_norm": grad_norm, "rm_lr": lr0})


def rm_pair_scores(ctx: CallContext, inputs: Data) -> CallResult:
    """Both responses' rewards of each pair (``pair_scores``: ``chosen`` [n], ``rejected`` [n]) and the pair
    metrics as sums over the pairs (``reward_model.PAIR_SUMS`` and ``n_pairs``; ``reward_model.pair_metrics``
    turns them into means)."""
    assert ctx.model is not None
    pairs = inputs["pairs"]
    seq = _both(pairs, slice(None))
    out = ctx.model.forward(forward_batch(seq), n_mbs=min(ctx.n_mbs, seq["tokens"].shape[0]), output="values")
    if out is None:
        return CallResult({}, {}, {})
    scores = last_token_scores(out.cpu(), seq, model_pad_id(ctx))
    n = scores.shape[0] // 2
    chosen, rejected = scores[:n], scores[n:]
    loss = bradley_terry_loss(chosen.double(), rejected.double(), pair_margins(ctx, pairs), ctx.config.center_coef)
    sums = {PAIR_SUMS[k]: v for k, v in _pair_sums(chosen, rejected, loss).items()}
    return CallResult({"pair_rewards": {"chosen": chosen, "rejected": rejected}}, {**sums, "n_pairs": float(n)}, {})
