"""Advantages and losses of GRPO, RLOO, ReMax, DPO and SFT against values computed by hand (``losses.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from realloc.algorithms import losses

S3 = math.sqrt(3.0)


def test_group_normalized_advantages():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0])
    # Group 2: mean 4/3, Bessel std sqrt(((8/3)^2 + 2 (4/3)^2) / 2) = 4/sqrt(3).
    want = torch.tensor([-1.0, 0.0, 1.0, (8 / 3) / (4 / S3), (-4 / 3) / (4 / S3), (-4 / 3) / (4 / S3)])
    torch.testing.assert_close(losses.group_advantages(scores, 3), want, atol=1e-5, rtol=0)
    # Dr. GRPO: centred only.
    torch.testing.assert_close(losses.group_advantages(scores, 3, scale=False),
                               torch.tensor([-1.0, 0.0, 1.0, 8 / 3, -4 / 3, -4 / 3]))
    # A group whose responses all scored the same carries no signal (not a division by zero).
    assert losses.group_advantages(torch.tensor([5.0, 5.0]), 2).abs().max() < 1e-6
    with pytest.raises(ValueError, match="groups of 4"):
        losses.group_advantages(scores, 4)


def test_leave_one_out_advantages():
    got = losses.leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0]), 5)
    # baseline of i = (10 - r_i) / 4
    want = torch.tensor([1 - 9 / 4, 2 - 8 / 4, 3 - 7 / 4, 0 - 10 / 4, 4 - 6 / 4])
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="at least 2"):
        losses.leave_one_out_advantages(torch.tensor([1.0]), 1)


def test_kl_estimators():
    logp, ref = torch.tensor([[math.log(0.5), math.log(0.2)]]), torch.tensor([[math.log(0.25), math.log(0.2)]])
    # k3 with r = log(0.25/0.5): exp(r) - r - 1
    torch.testing.assert_close(losses.k3_kl(logp, ref), torch.tensor([[0.5 + math.log(2) - 1, 0.0]]))
    mask = torch.tensor([[True, False]])
    torch.testing.assert_close(losses.sequence_kl(logp, ref, mask), torch.tensor([math.log(2)]))


def test_token_weights_normalizations():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(losses.token_weights(mask, "token", 3, 2, 3),
                               torch.tensor([[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]))
    torch.testing.assert_close(losses.token_weights(mask, "sequence", 3, 2, 3),
                               torch.tensor([[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]]))
    torch.testing.assert_close(losses.token_weights(mask, "constant", 3, 2, 3),
                               torch.tensor([[1 / 6, 1 / 6, 0], [1 / 6, 0, 0]]))
    # Weights come from whole-mini-batch counts: a rank holding half the mini-batch gets half the total.
    assert float(losses.token_weights(mask, "token", 6, 4, 3).sum()) == pytest.approx(0.5)


def test_clipped_surrogate_and_k3_term():
    w = torch.tensor([[0.5, 0.5]])
    # Ratio 1: the loss is -sum w A, nothing clipped.
    loss, st = losses.clipped_pg_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), w, 0.2)
    assert float(loss) == pytest.approx(-0.5) and st["clipped"] == 0.0
    # Ratio e^0.5: a positive advantage is clipped at 1.2, a negative one is not.
    logp = torch.full((1, 2), 0.5)
    loss, st = losses.clipped_pg_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), w, 0.2)
    assert float(loss) == pytest.approx(0.5 * (-1.2) + 0.5 * math.exp(0.5))
    assert st["clipped"] == pytest.approx(0.5) and st["approx_kl"] == pytest.approx(-0.5)
    # GRPO adds kl_coef * k3 per token.
    ref = torch.zeros(1, 2)
    loss_kl, st = losses.clipped_pg_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), w, 0.2, ref, 0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert float(loss_kl - loss) == pytest.approx(0.1 * k3, rel=1e-5) and st["k3_kl"] == pytest.approx(k3, rel=1e-5)
    # The gradient flows through logp: d/dlogp of -A r at ratio 1 is -A w.
    lp = torch.zeros(1, 2, requires_grad=True)
    losses.clipped_pg_loss(lp, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), w, 0.2)[0].backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.5]]))


def test_dpo_loss():
    chosen, rejected = torch.tensor([-1.0]), torch.tensor([-2.0])
    ref_c, ref_r = torch.tensor([-1.5]), torch.tensor([-1.5])
    per_pair, st = losses.dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    assert float(per_pair) == pytest.approx(math.log(1 + math.exp(-0.1)))
    assert float(st["chosen_reward"]) == pytest.approx(0.05) and float(st["rejected_reward"]) == pytest.approx(-0.05)
    assert float(st["margin"]) == pytest.approx(0.1)
    smoothed, _ = losses.dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1, label_smoothing=0.1)
    assert float(smoothed) == pytest.approx(0.9 * math.log(1 + math.exp(-0.1)) + 0.1 * math.log(1 + math.exp(0.1)))


def test_response_nll():
    logp = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    w = losses.token_weights(torch.tensor([[True, True, False]]), "token", 2, 1, 3)
    assert float(losses.response_nll(logp, w)) == pytest.approx((math.log(2) + math.log(4)) / 2)
