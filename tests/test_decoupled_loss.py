"""The decoupled PPO objective (AReaL, Fu et al. 2025; ``pg_loss.policy_loss`` with ``prox_logp``) against a per-token
formula written out in plain Python floats, and its reduction to the standard clipped surrogate when the
behaviour and proximal policies are one (staleness 0)."""

from __future__ import annotations

import math

import pytest
import torch

from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.algorithms.pg.pg_loss import LossOptions, policy_loss

OPTS = LossOptions(eps_low=0.2, eps_high=0.2)


def decoupled_pg_loss(logp, prox, behav, adv, w, eps, cap, ref=None, kl_coef=0.0, sequence_ratio=False,
                      mode="truncate"):
    opts = LossOptions(eps_low=eps, eps_high=eps, kl_coef=kl_coef, kl_estimator="k3", sequence_ratio=sequence_ratio)
    return policy_loss(logp, behav, adv, w, torch.ones_like(w, dtype=torch.bool), opts, ref_logp=ref,
                       prox_logp=prox, behav_cap=cap, behav_cap_mode=mode)


def _reference(logp, prox, behav, adv, w, eps, cap, mode="truncate"):
    """sum_t w_t iw_t max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(logp - prox), with iw = exp(prox - behav)
    capped: min(iw, cap) ("truncate"), or 0 where iw > cap ("mask", AReaL's)."""
    total = 0.0
    for lp, p, b, a, wt in zip(logp, prox, behav, adv, w):
        iw = math.exp(p - b)
        if cap is not None:
            iw = min(iw, cap) if mode == "truncate" else (iw if iw <= cap else 0.0)
        r = math.exp(lp - p)
        total += wt * iw * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
    return total


def test_decoupled_loss_matches_the_formula_with_and_without_the_cap():
    g = torch.Generator().manual_seed(0)
    n, T = 3, 5
    logp = -torch.rand(n, T, generator=g) * 2
    prox = logp + 0.3 * torch.randn(n, T, generator=g)
    behav = prox + torch.randn(n, T, generator=g)  # stale: some weights far above 1
    adv = torch.randn(n, T, generator=g)
    w = torch.rand(n, T, generator=g) / (n * T)
    flat = [x.reshape(-1).tolist() for x in (logp, prox, behav, adv, w)]
    for cap in (None, 2.0, 1.0):
        loss, st = decoupled_pg_loss(logp, prox, behav, adv, w, 0.2, cap)
        assert float(loss) == pytest.approx(_reference(*flat, 0.2, cap), rel=1e-5)
        capped = sum(wt for p, b, wt in zip(flat[1], flat[2], flat[4]) if cap is not None and math.exp(p - b) > cap)
        assert st["behav_capped"] == pytest.approx(capped, rel=1e-5)
    assert st["behav_capped"] > 0  # cap 1: every token the behaviour policy found less likely is cut
    # The gradient flows through logp only, scaled by the importance weight: at r = 1, d/dlogp = -A w iw.
    lp = prox.clone().requires_grad_(True)
    decoupled_pg_loss(lp, prox, behav, adv, w, 0.2, 2.0)[0].backward()
    torch.testing.assert_close(lp.grad, -adv * w * torch.exp(prox - behav).clamp(max=2.0))


def test_the_cap_either_truncates_or_masks_as_areal_does():
    """Issue 30, defect 5: behav_cap_mode="mask" gives a token whose weight exceeds the cap weight 0 (AReaL),
    "truncate" (the default) the cap; both against the hand-written formula, with the gradient of each."""
    g = torch.Generator().manual_seed(3)
    n, T = 3, 5
    logp = -torch.rand(n, T, generator=g) * 2
    prox = logp + 0.3 * torch.randn(n, T, generator=g)
    behav = prox + torch.randn(n, T, generator=g)
    adv, w = torch.randn(n, T, generator=g), torch.rand(n, T, generator=g) / (n * T)
    flat = [x.reshape(-1).tolist() for x in (logp, prox, behav, adv, w)]
    iw = torch.exp(prox - behav)
    assert 0 < int((iw > 2.0).sum()) < n * T  # some tokens above the cap, some below
    losses = {}
    for mode in ("truncate", "mask"):
        loss, st = decoupled_pg_loss(logp, prox, behav, adv, w, 0.2, 2.0, mode=mode)
        assert float(loss) == pytest.approx(_reference(*flat, 0.2, 2.0, mode), rel=1e-5)
        assert st["behav_capped"] == pytest.approx(float((w * (iw > 2.0)).sum()), rel=1e-5)
        losses[mode] = float(loss)
        lp = prox.clone().requires_grad_(True)
        decoupled_pg_loss(lp, prox, behav, adv, w, 0.2, 2.0, mode=mode)[0].backward()
        want = iw.clamp(max=2.0) if mode == "truncate" else torch.where(iw > 2.0, torch.zeros_like(iw), iw)
        torch.testing.assert_close(lp.grad, -adv * w * want)
    assert losses["truncate"] != losses["mask"]
    assert GRPOConfig().behav_cap_mode == "truncate" and GRPOConfig(behav_cap_mode="mask").behav_cap_mode == "mask"
    with pytest.raises(ValueError, match="behav_cap_mode must be 'truncate'"):
        GRPOConfig(decoupled=True, behav_cap_mode="drop")


def test_decoupled_loss_is_the_plain_loss_when_behaviour_is_proximal():
    """Token and sequence (GSPO) ratios, with the KL in the loss: prox = behaviour gives today's loss and
    gradient bit for bit (the weight is exp(0) = 1)."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 6, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.2 * torch.randn(4, 6, generator=g)
    adv, w, ref = torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g), -torch.rand(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    for seq_ratio in (False, True):
        opts = LossOptions(eps_low=0.2, eps_high=0.2, kl_coef=0.05, kl_estimator="k3", sequence_ratio=seq_ratio)
        a, sa = policy_loss(logp, old, adv, w, mask, opts, ref_logp=ref)
        (ga,) = torch.autograd.grad(a, logp)
        b, sb = decoupled_pg_loss(logp, old, old, adv, w, 0.2, 5.0, ref, 0.05, sequence_ratio=seq_ratio)
        (gb,) = torch.autograd.grad(b, logp)
        assert torch.equal(a, b) and torch.equal(ga, gb)
        assert {k: sb[k] for k in sa} == sa and sb["behav_capped"] == 0.0


def test_decoupled_settings_are_checked():
    assert GRPOConfig().decoupled is False  # off by default: today's loss
    with pytest.raises(ValueError, match="behav_weight_cap must be a number >= 1"):
        GRPOConfig(decoupled=True, behav_weight_cap=0.5)
    with pytest.raises(ValueError, match="decoupled must be True or False"):
        GRPOConfig(decoupled="yes")
    GRPOConfig(decoupled=True, behav_weight_cap=None)
