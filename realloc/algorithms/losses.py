"""Advantages and losses of the critic-free policy-gradient methods, DPO and SFT, on small tensors.

Per-token tensors are ``[n, T]`` and aligned with the response tokens (``common.py``); ``mask`` marks
the valid ones. Losses are written as ``sum_t weight_t * loss_t``: the weights carry the
normalization (per token, per sequence, or a constant), computed from counts over the whole
mini-batch (all dp ranks and micro-batches), so the gradient does not depend on how the
mini-batch is split -- the property that makes every plan take the same optimizer steps.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from realloc.algorithms.train_config import LOSS_NORMS  # noqa: F401  (torch-free, for the settings' checks)

LossNorm = Literal["sequence", "token", "constant"]


# -- advantages ------------------------------------------------------------------------------------------------
def group_advantages(scores: torch.Tensor, group: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1): each response's score minus its group's mean, divided by
    the group's standard deviation (Bessel-corrected) when ``scale``; Dr. GRPO (Liu et al. 2025) drops the
    division. ``scores`` [n] holds consecutive groups of ``group`` responses to one prompt."""
    g = _groups(scores, group).double()
    adv = g - g.mean(dim=1, keepdim=True)
    if scale and group > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1).to(scores.dtype)


def leave_one_out_advantages(scores: torch.Tensor, group: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, §3): each response's score minus the mean score of the other responses to
    the same prompt, ``r_i - (sum_j r_j - r_i) / (k - 1)``."""
    if group < 2:
        raise ValueError("leave-one-out needs at least 2 responses per prompt (n_samples >= 2)")
    g = _groups(scores, group).double()
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group - 1)
    return (g - baseline).reshape(-1).to(scores.dtype)


def _groups(scores: torch.Tensor, group: int) -> torch.Tensor:
    if scores.dim() != 1 or scores.numel() % group:
        raise ValueError(f"scores of shape {tuple(scores.shape)} do not split into groups of {group}")
    return scores.view(-1, group)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n]: the sampled estimate sum_t (log pi - log pi_ref) of each response's KL to the reference."""
    return ((logp - ref_logp) * mask.to(logp.dtype)).sum(dim=1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate ``exp(r) - r - 1`` with ``r = log pi_ref - log pi`` (Schulman's k3,
    unbiased and non-negative; the estimator GRPO puts in its loss)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1.0


# -- policy-gradient loss ----------------------------------------------------------------------------------------
def token_weights(mask: torch.Tensor, norm: LossNorm, n_tokens: float, n_seqs: float, gen_len: int) -> torch.Tensor:
    """[n, T] weights that turn per-token losses into a mini-batch loss (``n_tokens``/``n_seqs``: the whole
    mini-batch's counts).

    - ``sequence``: mean over each response's tokens, then over the responses (GRPO);
    - ``token``: mean over all tokens of the mini-batch (DAPO; what PPO here does);
    - ``constant``: sum over each response's tokens divided by ``gen_len``, mean over responses (Dr. GRPO:
      no per-response length normalization).
    """
    m = mask.to(torch.float32)
    if norm == "token":
        return m / max(n_tokens, 1.0)
    if norm == "sequence":
        return m / m.sum(dim=1, keepdim=True).clamp(min=1.0) / max(n_seqs, 1.0)
    if norm == "constant":
        return m / (gen_len * max(n_seqs, 1.0))
    raise ValueError(f"loss normalization must be one of {', '.join(LOSS_NORMS)}, got {norm!r}")


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                    clip_eps: float, ref_logp: torch.Tensor | None = None,
                    kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_t w_t [max(-A r, -A clip(r, 1 +- eps)) + kl_coef * k3_t]`` with ``r = exp(logp - old_logp)``;
    ``advantages`` [n, T] (a sequence's advantage repeated over its tokens). Stats are weighted sums."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None and kl_coef else None
    if kl is not None:
        per_token = per_token + kl_coef * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        valid = weights > 0
        stats = {"loss": float(loss), "clipped": float(((clipped > unclipped) & valid).to(weights.dtype).mul(weights).sum()),
                 "approx_kl": float(((old_logp - logp) * weights).sum()),
                 "k3_kl": float((kl * weights).sum()) if kl is not None else 0.0}
    return loss, stats


# -- DPO and SFT ------------------------------------------------------------------------------------------------
def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, beta: float, label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023, eq. 7) per pair, from the responses' summed log-probs [n]:
    ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``; with label smoothing eps (conservative DPO)
    ``-(1 - eps) log sigmoid(x) - eps log sigmoid(-x)``. Returns the per-pair losses and the implicit
    rewards ``beta * (pi - ref)`` of both responses."""
    chosen_reward = beta * (chosen_logp - ref_chosen_logp)
    rejected_reward = beta * (rejected_logp - ref_rejected_logp)
    logits = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, {"chosen_reward": chosen_reward.detach(), "rejected_reward": rejected_reward.detach(),
                    "margin": logits.detach()}


def response_nll(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """SFT: ``-sum_t w_t log p(token_t)`` over the response tokens (``weights`` as in ``token_weights``)."""
    return -(logp * weights).sum()
