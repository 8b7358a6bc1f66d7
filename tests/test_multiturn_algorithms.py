"""Policy-gradient algorithms on multi-turn rollouts, against reference computations written out here: PPO's
KL-shaped rewards and GAE over the policy's tokens alone (ppo/policy_tokens.py), with the environment's tokens
skipped, not treated as steps or episode ends."""

from __future__ import annotations

import pytest
import torch

from realloc.algorithms.ppo import policy_tokens, ppo


def _reference(scores, logp, ref_logp, values, mask, kl_coef, gamma, lam):
    """Per row, in plain Python: the policy's positions in order; reward -kl_coef * (logp - ref) on each, the score
    added on the last; GAE backwards over those positions only, the state after the last one terminal."""
    n, T = mask.shape
    adv, ret = torch.zeros(n, T, dtype=torch.float64), torch.zeros(n, T, dtype=torch.float64)
    for b in range(n):
        pos = [t for t in range(T) if mask[b, t]]
        r = [-kl_coef * (float(logp[b, t]) - float(ref_logp[b, t])) for t in pos]
        if pos:
            r[-1] += float(scores[b])
        next_v = next_a = 0.0
        for j in range(len(pos) - 1, -1, -1):
            v = float(values[b, pos[j]])
            delta = r[j] + gamma * next_v - v
            a = delta + gamma * lam * next_a
            adv[b, pos[j]], ret[b, pos[j]] = a, a + v
            next_v, next_a = v, a
    return adv, ret


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, T = 5, 12
    # prompt | obs | turn | obs | turn | padding, with different lengths per row; a row without any policy token
    rows = [[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0],
            [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1], [1] * 12, [0] * 12]
    mask = torch.tensor(rows, dtype=torch.bool)
    logp = -torch.rand(n, T, generator=g, dtype=torch.float64) * mask
    ref_logp = -torch.rand(n, T, generator=g, dtype=torch.float64) * mask
    values = torch.randn(n, T, generator=g, dtype=torch.float64)  # the critic's values everywhere; only policy's used
    scores = torch.randn(n, generator=g, dtype=torch.float64)
    return scores, logp, ref_logp, values, mask


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8)])
def test_ppo_advantages_run_over_the_policy_tokens_alone(gamma, lam):
    scores, logp, ref_logp, values, mask = _batch()
    adv, ret = policy_tokens.advantages(scores, logp, ref_logp, values, mask, 0.1, "k1", gamma, lam)
    want_adv, want_ret = _reference(scores, logp, ref_logp, values, mask, 0.1, gamma, lam)
    torch.testing.assert_close(adv, want_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, want_ret, rtol=1e-12, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # the environment's tokens are skipped, not episode ends: a turn's last token bootstraps from the next turn's
    b, last, first = 0, 4, 7
    assert adv[b, last] != pytest.approx(float(-0.1 * (logp[b, last] - ref_logp[b, last]) - values[b, last]))


def test_on_a_single_turn_response_they_are_ppo_s_own():
    scores, logp, ref_logp, values, _ = _batch(1)
    prefix = torch.arange(12)[None, :] < torch.tensor([3, 12, 0, 7, 1])[:, None]
    adv, ret = policy_tokens.advantages(scores, logp * prefix, ref_logp * prefix, values, prefix, 0.05, "k1", 1.0, 0.9)
    rewards, _ = ppo.kl_penalized_rewards(scores, logp * prefix, ref_logp * prefix, prefix, 0.05, "k1")
    want_adv, want_ret = ppo.gae(rewards, values, prefix, 1.0, 0.9)
    assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret)


def test_compact_and_expand_are_inverse():
    _, _, _, values, mask = _batch()
    packed, prefix = policy_tokens.compact(values, mask)
    assert torch.equal(prefix.sum(1), mask.sum(1))
    assert packed[0, :5].tolist() == values[0, [2, 3, 4, 7, 8]].tolist()
    assert torch.equal(policy_tokens.expand(packed, mask), values * mask)


def _ctx(cfg, n: int, group: int, gen_len: int):
    from realloc.algorithms.context import CallContext

    return CallContext(call=None, model=None, optimizer=None, config=cfg, prompt_len=4, gen_len=gen_len, seed=0,
                       iteration=0, ids=range(n), batch_size=n, n_mbs=1, group_size=group, eos_token_ids=(2,))


def _multiturn_inputs():
    scores, logp, ref_logp, _, mask = _batch(2)
    gen = torch.ones_like(mask)  # every row's conversation fills the budget; the policy wrote part of it
    gen[4] = False
    seq = {"gen_mask": gen, "loss_mask": mask, "tokens": torch.full((5, 16), 2), "prompt_lens": torch.full((5,), 4)}
    return {"seq": seq, "logp": {"logp": logp.float()}, "ref_logp": {"logp": ref_logp.float()},
            "rewards": {"score": scores.float()}}, mask


def test_reinforce_pp_returns_count_the_policy_tokens_alone():
    from realloc.algorithms.critic_free.pg_algorithms import ReinforcePPConfig
    from realloc.algorithms.critic_free.pg_steps import reinforce_pp_advantages, reinforce_pp_returns

    scores, logp, ref_logp, _, mask = _batch(3)
    got = reinforce_pp_returns(scores, logp, ref_logp, mask, 0.2, "k1", 0.9)
    # return-to-go over the policy's tokens: GAE with zero values and lambda 1 (the reference above)
    want, _ = _reference(scores, logp, ref_logp, torch.zeros_like(logp), mask, 0.2, 0.9, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs, mask = _multiturn_inputs()
    adv = reinforce_pp_advantages(_ctx(ReinforcePPConfig(kl_coef=0.2), 5, 1, 12), inputs, baseline=False)
    assert (adv[~mask] == 0).all() and (adv[mask] != 0).all()
    ret = reinforce_pp_returns(inputs["rewards"]["score"], inputs["logp"]["logp"], inputs["ref_logp"]["logp"], mask,
                               0.2, "k1", 1.0)
    vals = ret[mask].double()
    want = (vals - vals.mean()) / (vals.var(unbiased=False) + 1e-8).sqrt()  # normalized over the policy's tokens
    torch.testing.assert_close(adv[mask].double(), want, rtol=1e-5, atol=1e-5)


def test_dapo_on_multi_turn_rollouts_kl_over_policy_tokens_length_over_the_conversation():
    from realloc.algorithms import losses
    from realloc.algorithms.critic_free.critic_free import reward_kl
    from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig
    from realloc.algorithms.critic_free.pg_steps import dapo_selection

    inputs, mask = _multiturn_inputs()
    inputs["rewards"]["score"] = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0])[:5]
    cfg = DAPOConfig(kl_coef=0.1, dynamic_sampling=False, overlong_buffer=4, overlong_filter=False)
    sel = dapo_selection(_ctx(cfg, 5, 5, 12), inputs)
    # the KL term sums over the policy's tokens (the environment's carry logp 0 anyway), the overlong shaping
    # counts the whole conversation: 12 tokens of 12 for rows 0-3, none for row 4
    kl = reward_kl(cfg, inputs["logp"]["logp"], inputs["ref_logp"]["logp"], mask)
    shaped = inputs["rewards"]["score"] + torch.tensor([-1.0, -1.0, -1.0, -1.0, 0.0]) * cfg.overlong_penalty
    torch.testing.assert_close(sel.shaping, shaped - inputs["rewards"]["score"])
    want = losses.group_advantages(shaped - 0.1 * kl, 5, scale=True)
    torch.testing.assert_close(sel.advantages, want)
