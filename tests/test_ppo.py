"""PPO math against straightforward per-token Python loops written here from the formulas."""

import math

import pytest
import torch

from realloc.algorithms.ppo import ppo


def random_batch(n=5, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [T, 1, 0, 3, T - 1][:n]
    mask = torch.tensor([[t < L for t in range(T)] for L in lengths])
    return dict(
        mask=mask,
        logp=-torch.rand(n, T, generator=g, dtype=torch.float64) * 3,
        ref_logp=-torch.rand(n, T, generator=g, dtype=torch.float64) * 3,
        values=torch.randn(n, T, generator=g, dtype=torch.float64),
        scores=torch.randn(n, generator=g, dtype=torch.float64),
        lengths=lengths,
    )


def loop_rewards(b, kl_coef):
    out = []
    for i, L in enumerate(b["lengths"]):
        row = []
        for t in range(b["mask"].shape[1]):
            if t >= L:
                row.append(0.0)
                continue
            r = -kl_coef * (float(b["logp"][i, t]) - float(b["ref_logp"][i, t]))
            if t == L - 1:
                r += float(b["scores"][i])
            row.append(r)
        out.append(row)
    return out


def loop_gae(rewards, values, lengths, gamma, lam):
    advs, rets = [], []
    for i, L in enumerate(lengths):
        T = len(rewards[i])
        adv = [0.0] * T
        last = 0.0
        for t in reversed(range(L)):
            next_v = float(values[i, t + 1]) if t + 1 < L else 0.0
            delta = rewards[i][t] + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append([adv[t] + float(values[i, t]) if t < L else 0.0 for t in range(T)])
    return advs, rets


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_rewards_and_gae_match_loops(gamma, lam):
    b = random_batch()
    rewards, kl = ppo.kl_penalized_rewards(b["scores"], b["logp"], b["ref_logp"], b["mask"], kl_coef=0.1)
    expect_r = loop_rewards(b, 0.1)
    assert torch.allclose(rewards, torch.tensor(expect_r, dtype=torch.float64), atol=1e-12)
    assert float(kl[2].abs().sum()) == 0.0  # an empty response carries no KL and drops its score
    adv, ret = ppo.gae(rewards, b["values"], b["mask"], gamma, lam)
    expect_adv, expect_ret = loop_gae(expect_r, b["values"], b["lengths"], gamma, lam)
    assert torch.allclose(adv, torch.tensor(expect_adv, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(ret, torch.tensor(expect_ret, dtype=torch.float64), atol=1e-12)


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    b = random_batch()
    rewards, _ = ppo.kl_penalized_rewards(b["scores"], b["logp"], b["ref_logp"], b["mask"], kl_coef=0.05)
    adv, ret = ppo.gae(rewards, b["values"], b["mask"], gamma=0.9, lam=1.0)
    for i, L in enumerate(b["lengths"]):
        for t in range(L):
            g = sum(0.9 ** (k - t) * float(rewards[i, k]) for k in range(t, L))
            assert math.isclose(float(ret[i, t]), g, abs_tol=1e-12)
            assert math.isclose(float(adv[i, t]), g - float(b["values"][i, t]), abs_tol=1e-12)


def test_whiten_uses_batch_wide_moments_summed_over_shards():
    b = random_batch()
    x, mask = b["values"], b["mask"]
    # Moments of two "dp ranks" summed equal those of the whole batch, so whitening per shard with the
    # summed moments equals whitening the whole batch.
    m = ppo.masked_moments(x[:2], mask[:2]) + ppo.masked_moments(x[2:], mask[2:])
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    w = torch.cat([ppo.whiten(x[:2], mask[:2], m), ppo.whiten(x[2:], mask[2:], m)])
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            want = (float(x[i, t]) - mean) / math.sqrt(std ** 2 + 1e-8) if mask[i, t] else 0.0
            assert math.isclose(float(w[i, t]), want, abs_tol=1e-9)


def loop_actor_loss(logp, old, adv, mask, eps, n):
    total, clipped = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            a = float(adv[i, t])
            u, c = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            total += max(u, c)
            clipped += c > u
    return total / n, clipped


def loop_critic_loss(v, old, ret, mask, eps, n):
    total = 0.0
    for i in range(v.shape[0]):
        for t in range(v.shape[1]):
            if mask[i, t]:
                vc = float(old[i, t]) + min(max(float(v[i, t]) - float(old[i, t]), -eps), eps)
                total += 0.5 * max((float(v[i, t]) - float(ret[i, t])) ** 2, (vc - float(ret[i, t])) ** 2)
    return total / n


def test_actor_and_critic_losses_match_loops():
    b = random_batch(seed=3)
    g = torch.Generator().manual_seed(7)
    new_logp = b["logp"] + 0.4 * torch.randn(b["logp"].shape, generator=g, dtype=torch.float64)
    adv = torch.randn(b["logp"].shape, generator=g, dtype=torch.float64)
    n = 40.0
    loss, stats = ppo.actor_loss(new_logp, b["logp"], adv, b["mask"], 0.2, n)
    want, n_clipped = loop_actor_loss(new_logp, b["logp"], adv, b["mask"], 0.2, n)
    assert math.isclose(float(loss), want, rel_tol=1e-12)
    assert stats.clipped_tokens == n_clipped > 0 and stats.n_tokens == float(b["mask"].sum())
    new_v = b["values"] + 0.5 * torch.randn(b["values"].shape, generator=g, dtype=torch.float64)
    ret = torch.randn(b["values"].shape, generator=g, dtype=torch.float64)
    closs, cstats = ppo.critic_loss(new_v, b["values"], ret, b["mask"], 0.2, n)
    assert math.isclose(float(closs), loop_critic_loss(new_v, b["values"], ret, b["mask"], 0.2, n), rel_tol=1e-12)
    assert cstats.clipped_tokens > 0


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[0.5, -0.5]], dtype=torch.float64, requires_grad=True)  # ratios e^0.5, e^-0.5
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    loss, _ = ppo.actor_loss(logp, old, adv, torch.ones(1, 2, dtype=torch.bool), 0.2, 2.0)
    loss.backward()
    # Token 0 gained too much probability for a positive advantage: clipped, no gradient.
    # Token 1 lost probability: the unclipped term is the max, gradient -ratio/n.
    assert logp.grad[0, 0] == 0.0
    assert math.isclose(float(logp.grad[0, 1]), -math.exp(-0.5) / 2.0, rel_tol=1e-12)


def test_loss_gradient_is_independent_of_how_the_minibatch_is_split():
    """Summing per-shard losses normalized by the global token count reproduces the whole-batch gradient."""
    b = random_batch(seed=5)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(b["logp"].shape, generator=g, dtype=torch.float64)
    n_tokens = float(b["mask"].sum())

    def grad_of(splits):
        logp = b["logp"].clone().requires_grad_(True)
        for sl in splits:
            loss, _ = ppo.actor_loss(logp[sl] * 1.1, b["logp"][sl], adv[sl], b["mask"][sl], 0.2, n_tokens)
            loss.backward()
        return logp.grad

    whole = grad_of([slice(0, 5)])
    parts = grad_of([slice(0, 2), slice(2, 3), slice(3, 5)])
    assert torch.allclose(whole, parts, atol=1e-15)


def test_critic_clip_fraction_counts_no_rounding_noise():
    """fp32 values inside the clip range are never clipped, although ``old + (v - old)`` need not equal ``v``
    bit for bit; outside it, the count matches a float64 reference with the exact clip value ``old ± eps``."""
    g = torch.Generator().manual_seed(0)
    shape, eps = (641, 131), 0.2  # 83,971 tokens
    old = 0.3 * torch.randn(shape, generator=g)
    ret = torch.randn(shape, generator=g)
    mask = torch.ones(shape, dtype=torch.bool)
    # Values from another forward pass, not old + an fp32 step: rounded from float64.
    inside = (old.double() + eps * 0.999 * (2 * torch.rand(shape, generator=g, dtype=torch.float64) - 1)).float()
    v_clip = old + (inside - old).clamp(-eps, eps)
    assert (v_clip != inside).sum() > 1000  # the rounding the count must not see
    assert (((v_clip - ret) ** 2 > (inside - ret) ** 2)).sum() > 100  # and which the old count took for clipping
    _, st = ppo.critic_loss(inside, old, ret, mask, eps, 1.0)
    assert st.clipped_tokens == 0

    moved = old + 0.5 * torch.randn(shape, generator=g)
    _, st = ppo.critic_loss(moved, old, ret, mask, eps, 1.0)
    v, o, r = moved.double(), old.double(), ret.double()
    outside = (v - o).abs() > eps
    exact_clip = o + eps * torch.sign(v - o)
    want = (outside & ((exact_clip - r) ** 2 > (v - r) ** 2)).sum()
    assert st.clipped_tokens == float(want) > 10000
