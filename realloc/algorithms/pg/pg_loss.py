"""The policy-gradient loss options every policy-gradient algorithm shares, and the loss they configure.

Settings (:class:`PGLossConfig` in ``pg_config.py``, the base of ``PPOConfig`` and of the critic-free configs):

- ``clip_eps`` / ``clip_eps_high``: the trust region ``clip(r, 1 - eps_low, 1 + eps_high)``; a larger upper
  bound is DAPO's clip-higher (Yu et al. 2025, §3.1), None keeps it symmetric.
- ``dual_clip``: dual-clip PPO (Ye et al. 2020, eq. 5): for a negative advantage the surrogate is bounded by
  ``c x A`` as well, so a huge ratio on a bad token cannot blow the loss up (c > 1; None: off).
- ``entropy_coef``: an entropy bonus, ``- coef x H(pi(. | s_t))`` per response token.
- ``kl_coef``, ``kl_estimator`` (k1, k2, k3) and ``kl_placement``: the KL to the reference, estimated per token
  from the sampled token (Schulman 2020, "Approximating KL divergence"), subtracted from the reward
  (``"reward"``: the algorithm's advantage sees it) or added to the loss (``"loss"``: its gradient does).

All per-token tensors are ``[n, T]`` and aligned with the response tokens (``common.py``); the loss is
``sum_t w_t loss_t`` with the mini-batch normalization in the weights (``losses.token_weights``).
"""

from __future__ import annotations

import dataclasses

import torch

from realloc.algorithms.pg.pg_config import KL_ESTIMATORS, KL_PLACEMENTS, PGLossConfig

__all__ = ["KL_ESTIMATORS", "KL_PLACEMENTS", "LossOptions", "PGLossConfig", "kl_estimate", "loss_options",
           "policy_loss"]

def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token, with ``d = log pi - log pi_ref``:
    k1 = d (unbiased, may be negative), k2 = d^2 / 2 (biased, low variance; its gradient is that of KL's),
    k3 = exp(-d) - 1 + d (unbiased and non-negative) (Schulman 2020)."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """What ``policy_loss`` applies (built from a ``PGLossConfig`` by ``loss_options``)."""

    eps_low: float
    eps_high: float
    dual_clip: float | None = None
    kl_coef: float = 0.0  # in the loss
    kl_estimator: str = "k1"
    entropy_coef: float = 0.0
    sequence_ratio: bool = False  # GSPO: one length-normalized ratio per response
    token_level: bool = False  # with sequence_ratio, GSPO-token: the response's ratio, a surrogate per token


def loss_options(cfg: PGLossConfig, sequence_ratio: bool = False) -> LossOptions:
    return LossOptions(eps_low=cfg.clip_eps, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, kl_coef=cfg.kl_in_loss,
                       kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef, sequence_ratio=sequence_ratio,
                       token_level=sequence_ratio and bool(getattr(cfg, "token_level", False)))


def _surrogate(ratio: torch.Tensor, adv: torch.Tensor, opts: LossOptions) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """(loss, clipped, dual-clipped): ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, and with dual clip
    ``min(that, -c A)`` where A < 0."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - opts.eps_low, 1.0 + opts.eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    dual = torch.zeros_like(was_clipped)
    if opts.dual_clip is not None:
        bound = -opts.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, was_clipped, dual


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor,
                mask: torch.Tensor, opts: LossOptions, ref_logp: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, prox_logp: torch.Tensor | None = None,
                behav_cap: float | None = None, behav_cap_mode: str = "truncate"
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss with its options; ``adv`` [n, T] per token.

    Token ratio (PPO): ``sum_t w_t [surrogate(r_t, A_t) + kl_coef k_t - entropy_coef H_t]`` with
    ``r_t = exp(logp_t - old_t)``.
    Sequence ratio (GSPO, Zheng et al. 2025 eq. 7): ``s_i = exp(mean_t (logp_t - old_t))`` over response i's
    tokens, one surrogate per response ``surrogate(s_i, A_i)`` weighted by ``sum_t w_t`` (A_i: the response's
    advantage, constant over its tokens), plus the per-token KL and entropy terms.
    GSPO-token (Zheng et al. 2025, the token-level variant; ``token_level``): per token
    ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (the value of s_i, the gradient of token t's log-prob scaled by
    it) and ``sum_t w_t surrogate(s_i,t, A_i,t)``: per-token advantages; with A constant over a response, the
    loss and its gradient are GSPO's.

    Decoupled (``prox_logp`` given; AReaL, ``decoupled.py``): the ratio is taken against the proximal policy
    ``prox_logp`` instead of ``old_logp`` (the behaviour policy that sampled), and each surrogate is weighted by
    ``w = pi_prox / pi_behav`` (per token, or per response under the sequence ratio), capped: ``min(w, behav_cap)``
    with ``behav_cap_mode="truncate"``, ``w if w <= behav_cap else 0`` with ``"mask"`` (AReaL's); with
    ``prox_logp == old_logp`` the weight is 1 and the loss is the plain one, bit for bit.

    Stats are weighted sums (means once divided by the total weight): loss, clipped, dual_clipped, approx_kl,
    kl (the loss's KL term, when it has one), entropy (when it has a bonus), behav_weight and behav_capped
    (decoupled: the mean weight after the cap, and the share the cap cut).
    """
    maskf = mask.to(logp.dtype)
    anchor = old_logp if prox_logp is None else prox_logp
    log_ratio = (logp - anchor) * maskf
    behav_log = None if prox_logp is None else ((prox_logp - old_logp) * maskf).detach()
    stats = {}
    if opts.sequence_ratio and opts.token_level:
        n_tok = maskf.sum(dim=1).clamp(min=1.0)
        seq_ratio = torch.exp(log_ratio.sum(dim=1) / n_tok).detach()
        tok_ratio = seq_ratio.view(-1, 1) * torch.exp(logp - logp.detach())
        surr, was_clipped, dual = _surrogate(tok_ratio, adv, opts)
        if behav_log is not None:
            surr = surr * _behaviour_weight(torch.exp(behav_log.sum(dim=1) / n_tok), behav_cap, behav_cap_mode,
                                            weights.sum(dim=1), stats).view(-1, 1)
        loss = (surr * weights).sum()
        clip_w, dual_w = (was_clipped.to(weights.dtype) * weights).sum(), (dual.to(weights.dtype) * weights).sum()
    elif opts.sequence_ratio:
        n_tok = maskf.sum(dim=1).clamp(min=1.0)
        seq_ratio = torch.exp(log_ratio.sum(dim=1) / n_tok)
        seq_adv = (adv * maskf).sum(dim=1) / n_tok
        seq_w = weights.sum(dim=1)
        surr, was_clipped, dual = _surrogate(seq_ratio, seq_adv, opts)
        if behav_log is not None:
            surr = surr * _behaviour_weight(torch.exp(behav_log.sum(dim=1) / n_tok), behav_cap, behav_cap_mode, seq_w,
                                            stats)
        loss = (surr * seq_w).sum()
        clip_w, dual_w = (was_clipped.to(weights.dtype) * seq_w).sum(), (dual.to(weights.dtype) * seq_w).sum()
    else:
        surr, was_clipped, dual = _surrogate(torch.exp(log_ratio), adv, opts)
        if behav_log is not None:
            surr = surr * _behaviour_weight(torch.exp(behav_log), behav_cap, behav_cap_mode, weights, stats)
        loss = (surr * weights).sum()
        clip_w, dual_w = (was_clipped.to(weights.dtype) * weights).sum(), (dual.to(weights.dtype) * weights).sum()
    if opts.kl_coef and ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, opts.kl_estimator)
        loss = loss + opts.kl_coef * (kl * weights).sum()
        stats["kl"] = float((kl.detach() * weights).sum())
    if opts.entropy_coef and entropy is not None:
        loss = loss - opts.entropy_coef * (entropy * weights).sum()
        stats["entropy"] = float((entropy.detach() * weights).sum())
    with torch.no_grad():
        stats.update({"loss": float(loss), "clipped": float(clip_w), "dual_clipped": float(dual_w),
                      "approx_kl": float(((anchor - logp) * weights).sum())})
    return loss, stats


def _behaviour_weight(raw: torch.Tensor, cap: float | None, mode: str, weights: torch.Tensor,
                      stats: dict[str, float]) -> torch.Tensor:
    """The capped importance weight, its stats added: ``min(raw, cap)`` ("truncate": truncated importance
    sampling, IMPALA's rho-bar) or ``raw`` where ``raw <= cap`` and 0 above ("mask": AReaL's
    ``behav_imp_weight_cap`` drops those tokens from the loss)."""
    if cap is None:
        w = raw
    elif mode == "mask":
        w = torch.where(raw > cap, torch.zeros_like(raw), raw)
    else:
        w = raw.clamp(max=cap)
    stats["behav_weight"] = float((w * weights).sum())
    cut = raw > cap if cap is not None else torch.zeros_like(raw, dtype=torch.bool)
    stats["behav_capped"] = float((cut.to(weights.dtype) * (weights > 0).to(weights.dtype) * weights).sum())
    return w
