"""PPO for RLHF: KL-shaped rewards, GAE, advantage whitening, clipped actor and critic losses.

All per-token tensors are ``[n_seqs, gen_len]`` and aligned with the generated (response) tokens:
column t holds the quantity of response token t. ``mask`` marks the valid response tokens; it is a
prefix of each row (generation may stop at EOS before ``gen_len``).

Losses are sums over tokens divided by a caller-supplied token count: the number of valid tokens
of the whole PPO mini-batch across all data-parallel ranks and micro-batches. Dividing by the
global count (instead of averaging per micro-batch) makes the gradient independent of how the
mini-batch is split over dp ranks and micro-batches, which is what lets different execution plans
produce the same training trajectory.
"""

from __future__ import annotations

import dataclasses

import torch

from realloc.algorithms.pg.pg_loss import kl_estimate


@dataclasses.dataclass(frozen=True)
class LossStats:
    """Sums (not means) so that ranks and micro-batches can be added up before dividing."""

    loss_sum: float
    clipped_tokens: float
    approx_kl_sum: float
    n_tokens: float


def kl_penalized_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         kl_coef: float, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef * kl_t`` on every token, plus the sequence score on the last valid token (the
    usual RLHF reward shaping with a per-token KL penalty against the reference); ``kl_t`` is the ``estimator``'s
    (``pg_loss.kl_estimate``; k1: ``logp - ref_logp``).

    Returns ``(rewards, kl)``; both are zero on masked positions.
    """
    maskf = mask.to(logp.dtype)
    kl = kl_estimate(logp, ref_logp, estimator) * maskf
    rewards = -kl_coef * kl
    n_valid = mask.sum(dim=1)
    has_tokens = n_valid > 0
    last = (n_valid - 1).clamp(min=0)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += torch.where(has_tokens, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over response tokens.

    ``values[:, t]`` is the critic's estimate of the state before token t is emitted; the state after
    the last valid token is terminal (value 0). Returns ``(advantages, returns)``, zero where masked.
    """
    maskf = mask.to(values.dtype)
    n, T = rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(n, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(T - 1, -1, -1):
        m = maskf[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = (delta + gamma * lam * next_adv) * m
        adv[:, t] = a
        # Past the last valid token both carries restart from zero: the episode has ended there.
        next_value = values[:, t] * m
        next_adv = a
    returns = (adv + values) * maskf
    return adv, returns


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares, count]`` in float64, to be all-reduced over data-parallel ranks."""
    m = mask.to(torch.float64)
    xd = x.to(torch.float64) * m
    return torch.stack([xd.sum(), (xd * xd).sum(), m.sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalize ``x`` to zero mean and unit variance using batch-wide ``moments`` (see masked_moments)."""
    total, total_sq, count = (float(v) for v in moments)
    if count <= 0:
        return torch.zeros_like(x)
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    return ((x - mean) / (var + eps) ** 0.5) * mask.to(x.dtype)


def actor_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_eps: float, n_tokens: float) -> tuple[torch.Tensor, LossStats]:
    """Clipped surrogate objective (PPO, Schulman et al. 2017), summed over tokens / ``n_tokens``."""
    maskf = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped) * maskf
    loss = per_token.sum() / n_tokens
    with torch.no_grad():
        stats = LossStats(loss_sum=float(per_token.sum()),
                          clipped_tokens=float(((clipped > unclipped).to(logp.dtype) * maskf).sum()),
                          approx_kl_sum=float(((old_logp - logp) * maskf).sum()),
                          n_tokens=float(maskf.sum()))
    return loss, stats


def critic_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                clip_eps: float, n_tokens: float) -> tuple[torch.Tensor, LossStats]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (v_clip - R)^2)`` with v_clip within ``clip_eps`` of
    the value at rollout time; summed over tokens / ``n_tokens``."""
    maskf = mask.to(values.dtype)
    v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    unclipped = (values - returns) ** 2
    clipped = (v_clip - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped) * maskf
    loss = per_token.sum() / n_tokens
    with torch.no_grad():
        # Inside the range ``old + (v - old)`` need not round back to ``v``, so ``clipped > unclipped`` alone
        # would count rounding noise (and depend on the plan): a token is clipped only once its value left
        # the range and the clipped term is the larger one, i.e. its gradient is cut.
        cut = ((values - old_values).abs() > clip_eps) & (clipped > unclipped)
        stats = LossStats(loss_sum=float(per_token.sum()), clipped_tokens=float((cut.to(values.dtype) * maskf).sum()),
                          approx_kl_sum=0.0, n_tokens=float(maskf.sum()))
    return loss, stats
