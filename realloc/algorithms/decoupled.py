"""The decoupled PPO objective of asynchronous RL (AReaL: Fu et al. 2025, §5.2 "Decoupled PPO objective").

With bounded staleness the responses a train step learns from were sampled by an older policy, the
*behaviour* policy pi_behav (the generation's log-probs). The decoupled objective separates it from the
*proximal* policy pi_prox that the trust region is taken around: the parameters before this train step's
first update (the current version). Per token, with A the advantage,

    w = pi_prox / pi_behav                      (importance weight, capped at ``cap``)
    r = pi_theta / pi_prox                      (the ratio PPO clips)
    loss_t = w * max(-A r, -A clip(r, 1 - eps, 1 + eps))

When the responses are on-policy (staleness 0 and the generation's log-probs equal the train step's),
pi_prox = pi_behav, w = 1 and this is the standard clipped surrogate. The cap truncates the weight, as
truncated importance sampling does (IMPALA's rho-bar; AReaL's ``behav_imp_weight_cap``), so that a
token the behaviour policy found far less likely than the current policy cannot dominate a step.
"""

from __future__ import annotations

from typing import Mapping

import torch

from realloc.algorithms.common import forward_batch, response_columns
from realloc.algorithms.context import CallContext
from realloc.algorithms.losses import k3_kl


def decoupled_pg_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                      advantages: torch.Tensor, weights: torch.Tensor, clip_eps: float, cap: float | None,
                      ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_t w_t min(pi_prox/pi_behav, cap) max(-A r, -A clip(r, 1 +- eps))`` (+ ``kl_coef`` x k3 to the
    reference, unweighted, as in ``losses.clipped_pg_loss``); ``r = exp(logp - prox_logp)``; all [n, T].
    Stats are weighted sums, the keys of ``clipped_pg_loss`` plus ``behav_weight`` (the mean importance weight
    after the cap) and ``behav_capped`` (the share of tokens whose weight the cap cut)."""
    with torch.no_grad():
        raw = torch.exp(prox_logp - behav_logp)
        behav = raw.clamp(max=cap) if cap is not None else raw
    ratio = torch.exp(logp - prox_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = behav * torch.maximum(unclipped, clipped)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None and kl_coef else None
    if kl is not None:
        per_token = per_token + kl_coef * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        valid = (weights > 0).to(weights.dtype)
        stats = {"loss": float(loss), "clipped": float(((clipped > unclipped).to(weights.dtype) * weights).sum()),
                 "approx_kl": float(((prox_logp - logp) * weights).sum()),
                 "k3_kl": float((kl * weights).sum()) if kl is not None else 0.0,
                 "behav_weight": float((behav * weights).sum()),
                 "behav_capped": float(((raw > behav).to(weights.dtype) * valid * weights).sum())}
    return loss, stats


def proximal_logprobs(ctx: CallContext, seq: Mapping[str, torch.Tensor], mb_of_row: torch.Tensor) -> torch.Tensor:
    """[n, T] log-probs of the responses under the parameters before this train step (the decoupled
    objective's proximal policy), for the rows of mini-batches 1.. (mini-batch 0 takes them from its own
    forward); zeros elsewhere, and on pipeline stages other than the last (which computes no loss)."""
    mask = seq["gen_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    rows = torch.nonzero(mb_of_row != 0).view(-1)
    if rows.numel() == 0:
        return out
    assert ctx.model is not None
    part = {n: t[rows] for n, t in seq.items()}
    with torch.no_grad():
        lp = ctx.model.forward(forward_batch(part), n_mbs=min(ctx.n_mbs, rows.numel()), output="logprobs",
                               temperature=ctx.config.temperature)
    if lp is not None:
        out[rows] = response_columns(lp.cpu(), part["prompt_lens"], part["gen_mask"]).to(out.dtype)
    return out
