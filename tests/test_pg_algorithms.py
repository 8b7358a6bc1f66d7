"""REINFORCE++, DAPO, GSPO and the policy-gradient loss options against values computed by hand from the papers'
formulas (``pg_loss.py``, ``pg_steps.py``), their settings' checks, and their graphs as the estimator and the
search see them.

- KL estimators (Schulman 2020): k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d with d = log pi - log pi_ref;
- clip-higher (DAPO eq. 10), dual clip (Ye et al. 2020 eq. 5), the entropy bonus and the KL in the loss: loss
  values and gradients of small tensors;
- GSPO's sequence-level ratio (Zheng et al. 2025 eq. 7): s_i = exp(mean_t log ratio), clipped per response;
- REINFORCE++'s return-to-go of KL-shaped token rewards and its batch normalization, and the baseline variant's
  group mean (Hu et al. 2025);
- DAPO's overlong penalty (eq. 13) and dynamic sampling: no all-equal group is trained, the train batch takes the
  first ``train_prompts`` groups that differ, and the estimator prices the whole generation batch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from realloc.algorithms.context import CallContext
from realloc.algorithms.critic_free.grpo import GRPOConfig, RLOOConfig
from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig, GSPOConfig, ReinforcePPConfig
from realloc.algorithms.critic_free.pg_steps import (dapo_selection, dynamic_sampling_positions,
                                                      overlong_penalty, reinforce_pp_advantages, reinforce_pp_returns)
from realloc.algorithms.pg import pg_loss
from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import load_experiment
from realloc.cli import main
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.overrides import apply_overrides
from realloc.strategy import ParallelStrategy

from hf_assets import REPO

LN2 = math.log(2.0)


def test_kl_estimators_against_hand_values():
    logp, ref = torch.tensor([[math.log(0.5), math.log(0.2)]]), torch.tensor([[math.log(0.25), math.log(0.4)]])
    # d = log 2 and -log 2
    torch.testing.assert_close(pg_loss.kl_estimate(logp, ref, "k1"), torch.tensor([[LN2, -LN2]]))
    torch.testing.assert_close(pg_loss.kl_estimate(logp, ref, "k2"), torch.tensor([[LN2 ** 2 / 2, LN2 ** 2 / 2]]))
    torch.testing.assert_close(pg_loss.kl_estimate(logp, ref, "k3"), torch.tensor([[0.5 - 1 + LN2, 2 - 1 - LN2]]))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        pg_loss.kl_estimate(logp, ref, "k4")


def _opts(**kw) -> pg_loss.LossOptions:
    return pg_loss.LossOptions(**{"eps_low": 0.2, "eps_high": 0.2, **kw})


def _loss(logp, old, adv, w, opts, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, st = pg_loss.policy_loss(lp, old, adv, w, torch.ones(logp.shape, dtype=torch.bool), opts, **kw)
    loss.backward()
    return float(loss.detach()), lp.grad, st


def test_clip_higher_bounds_the_ratio_asymmetrically():
    w = torch.tensor([[0.5, 0.5]])
    old = torch.zeros(1, 2)
    # Token 0: A = +1, ratio e^0.3 = 1.35 -> clipped at 1 + eps_high; token 1: A = -1, ratio e^-0.3 = 0.74 -> at 1 - eps_low.
    logp, adv = torch.tensor([[0.3, -0.3]]), torch.tensor([[1.0, -1.0]])
    sym, g_sym, st = _loss(logp, old, adv, w, _opts())
    assert sym == pytest.approx(0.5 * -1.2 + 0.5 * 0.8) and st["clipped"] == pytest.approx(1.0)
    high, g_high, st = _loss(logp, old, adv, w, _opts(eps_high=0.28))
    assert high == pytest.approx(0.5 * -1.28 + 0.5 * 0.8)
    # e^0.3 < 1.4: with eps_high 0.4 token 0 is inside the region and has a gradient -A w r.
    _, g, st = _loss(logp, old, adv, w, _opts(eps_high=0.4))
    torch.testing.assert_close(g, torch.tensor([[-0.5 * math.exp(0.3), 0.0]]))
    assert st["clipped"] == pytest.approx(0.5)
    torch.testing.assert_close(g_sym, torch.zeros(1, 2))


def test_dual_clip_bounds_a_negative_advantage_at_c_times_a():
    w = torch.tensor([[0.5, 0.5, 0.0]])
    old = torch.zeros(1, 3)
    # A = -1 with ratios 5 and 2, A = +1 with ratio 5 (weight 0 -- excluded from everything).
    logp, adv = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]]), torch.tensor([[-1.0, -1.0, 1.0]])
    plain, g_plain, _ = _loss(logp, old, adv, w, _opts())
    assert plain == pytest.approx(0.5 * 5 + 0.5 * 2)
    dual, g, st = _loss(logp, old, adv, w, _opts(dual_clip=3.0))
    # min(max(-A r, -A clip r), -c A): 5 -> 3 (no gradient), 2 stays 2 (gradient -A w r = 0.5 * 2)
    assert dual == pytest.approx(0.5 * 3 + 0.5 * 2) and st["dual_clipped"] == pytest.approx(0.5)
    torch.testing.assert_close(g, torch.tensor([[0.0, 1.0, 0.0]]))
    torch.testing.assert_close(g_plain, torch.tensor([[2.5, 1.0, 0.0]]))


def test_entropy_bonus_and_kl_in_the_loss():
    w = torch.tensor([[0.25, 0.75]])
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    ent = torch.tensor([[2.0, 1.0]], requires_grad=True)
    zero = torch.zeros(1, 2)
    # At ratio 1 with A = 0 the surrogate is 0: the loss is kl_coef sum w k2 - entropy_coef sum w H.
    lp = logp.clone().requires_grad_(True)
    loss, st = pg_loss.policy_loss(lp, logp, zero, w, torch.ones(1, 2, dtype=torch.bool),
                                   _opts(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01), ref_logp=ref, entropy=ent)
    loss.backward()
    d = torch.tensor([0.5, -1.0])
    k2 = 0.5 * d * d
    assert float(loss.detach()) == pytest.approx(0.1 * float((w * k2).sum()) - 0.01 * (0.25 * 2 + 0.75 * 1))
    assert st["kl"] == pytest.approx(float((w * k2).sum())) and st["entropy"] == pytest.approx(1.25)
    # d/dlogp of 0.1 * w * d^2 / 2 is 0.1 w d; d/dH of -0.01 w H is -0.01 w
    torch.testing.assert_close(lp.grad, 0.1 * w * d)
    torch.testing.assert_close(ent.grad, -0.01 * w)


def test_gspo_clips_the_length_normalized_sequence_ratio():
    # Response 0: 2 tokens with log-ratios 0.1 and 0.3 -> s = e^0.2; response 1: 1 token, -0.2 -> s = e^-0.2.
    logp = torch.tensor([[0.1, 0.3], [-0.2, 5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    w = torch.tensor([[0.25, 0.25], [0.5, 0.0]])  # "sequence" norm: each response weighs 1/2
    seq = dict(sequence_ratio=True)

    def run(eps):
        lp = logp.clone().requires_grad_(True)
        loss, st = pg_loss.policy_loss(lp, old, adv, w, mask, _opts(eps_low=eps, eps_high=eps, **seq))
        loss.backward()
        return float(loss.detach()), lp.grad, st

    loss, g, st = run(0.3)  # both ratios inside [0.7, 1.3]
    assert loss == pytest.approx(0.5 * -math.exp(0.2) + 0.5 * math.exp(-0.2)) and st["clipped"] == 0.0
    # d s_i / d logp_t = s_i / |y_i|: the response's tokens share its gradient equally.
    torch.testing.assert_close(g, torch.tensor([[-0.5 * math.exp(0.2) / 2] * 2, [0.5 * math.exp(-0.2), 0.0]]))
    loss, g, st = run(0.1)  # e^0.2 > 1.1 with A > 0, e^-0.2 < 0.9 with A < 0: both clipped, no gradient
    assert loss == pytest.approx(0.5 * -1.1 + 0.5 * 0.9) and st["clipped"] == pytest.approx(1.0)
    torch.testing.assert_close(g, torch.zeros(2, 2))
    # Token-level ratios (PPO's) weigh response 0's tokens by their own ratios, e^0.1 and e^0.3, not both by e^0.2.
    _, g_tok, _ = _loss(logp, old, adv * mask, w, _opts(eps_low=0.4, eps_high=0.4))
    torch.testing.assert_close(g_tok[0], torch.tensor([-0.25 * math.exp(0.1), -0.25 * math.exp(0.3)]))


def _ctx(cfg, n: int, group: int, gen_len: int, batch: int | None = None, start: int = 0) -> CallContext:
    return CallContext(call=None, model=None, optimizer=None, config=cfg, prompt_len=4, gen_len=gen_len, seed=0,
                       iteration=0, ids=range(start, start + n), batch_size=batch or n, n_mbs=1, group_size=group)


def _whiten(x: list[float]) -> list[float]:
    mean = sum(x) / len(x)
    var = sum((v - mean) ** 2 for v in x) / len(x)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in x]


def test_reinforce_pp_returns_and_batch_normalization():
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -2.0, -1.0]])
    ref = torch.tensor([[-1.1, -1.2, -3.0], [-0.8, -2.0, -1.0]])  # k1 = logp - ref: 0.1, 0.2 | 0.3
    mask = torch.tensor([[True, True, False], [True, False, False]])
    scores = torch.tensor([1.0, 0.0])
    # r_t = -0.5 k1_t (+ score on the last token): (-0.05, 0.9) and (-0.15); returns-to-go 0.85, 0.9 | -0.15.
    got = reinforce_pp_returns(scores, logp, ref, mask, 0.5, "k1", 1.0)
    torch.testing.assert_close(got, torch.tensor([[0.85, 0.9, 0.0], [-0.15, 0.0, 0.0]]))
    # gamma 0.5: G_0 = -0.05 + 0.5 * 0.9
    assert float(reinforce_pp_returns(scores, logp, ref, mask, 0.5, "k1", 0.5)[0, 0]) == pytest.approx(0.4)
    inputs = {"seq": {"gen_mask": mask}, "logp": {"logp": logp}, "ref_logp": {"logp": ref},
              "rewards": {"score": scores}}
    adv = reinforce_pp_advantages(_ctx(ReinforcePPConfig(kl_coef=0.5), 2, 1, 3), inputs, baseline=False)
    want = _whiten([0.85, 0.9, -0.15])
    torch.testing.assert_close(adv[mask], torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert float(adv[~mask].abs().sum()) == 0.0
    # KL in the loss instead: the token rewards carry only the score.
    adv = reinforce_pp_advantages(_ctx(ReinforcePPConfig(kl_coef=0.5, kl_placement="loss"), 2, 1, 3), inputs, False)
    torch.testing.assert_close(adv[mask], torch.tensor(_whiten([1.0, 1.0, 0.0])), atol=1e-5, rtol=1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_normalizing():
    mask = torch.ones(4, 1, dtype=torch.bool)
    zeros = torch.zeros(4, 1)
    inputs = {"seq": {"gen_mask": mask}, "logp": {"logp": zeros}, "ref_logp": {"logp": zeros},
              "rewards": {"score": torch.tensor([1.0, 0.0, 3.0, 3.0])}}
    adv = reinforce_pp_advantages(_ctx(ReinforcePPConfig(), 4, 2, 1), inputs, baseline=True)
    # groups (1, 0) and (3, 3): centred 0.5, -0.5, 0, 0, then normalized over the batch
    torch.testing.assert_close(adv.view(-1), torch.tensor(_whiten([0.5, -0.5, 0.0, 0.0])), atol=1e-5, rtol=1e-5)
    plain = reinforce_pp_advantages(_ctx(ReinforcePPConfig(), 4, 2, 1), inputs, baseline=False)
    torch.testing.assert_close(plain.view(-1), torch.tensor(_whiten([1.0, 0.0, 3.0, 3.0])), atol=1e-5, rtol=1e-5)


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([4, 5, 6, 7, 8])
    # L_max 8, L_cache 4: free up to 4 tokens, then (4 - |y|) / 4
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4), torch.tensor([0.0, -0.25, -0.5, -0.75, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4, penalty=0.5),
                               torch.tensor([0.0, -0.125, -0.25, -0.375, -0.5]))
    assert float(overlong_penalty(lengths, 8, 0).abs().sum()) == 0.0


def test_dynamic_sampling_positions():
    keep = torch.tensor([True, False, True, True])
    torch.testing.assert_close(dynamic_sampling_positions(keep, 2, 2), torch.tensor([0, 1, -1, -1, 2, 3, -1, -1]))
    torch.testing.assert_close(dynamic_sampling_positions(keep, 2, 8), torch.tensor([0, 1, -1, -1, 2, 3, 4, 5]))


def _dapo_inputs(scores: list[float], lengths: list[int], T: int) -> dict:
    n = len(scores)
    mask = torch.arange(T).view(1, T) < torch.tensor(lengths).view(n, 1)
    zeros = torch.zeros(n, T)
    return {"seq": {"gen_mask": mask}, "logp": {"logp": zeros}, "ref_logp": {"logp": zeros},
            "rewards": {"score": torch.tensor(scores)}}


def test_dapo_drops_all_equal_groups_and_refills_the_train_batch():
    # 5 groups of 3 (batch 15): groups 0 and 3 all equal, group 4 differs only through the overlong penalty.
    scores = [1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    lengths = [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 2]
    inputs = _dapo_inputs([float(s) for s in scores], lengths, 4)
    cfg = DAPOConfig(train_prompts=3, overlong_buffer=2)
    sel = dapo_selection(_ctx(cfg, 15, 3, 4), inputs)
    assert (sel.groups_kept, sel.groups_trained) == (3, 3)
    # kept: groups 1, 2, 4 (4 through the penalty of its 4-token response: -1) -> positions 0..8 in order
    want = [-1] * 3 + [0, 1, 2] + [3, 4, 5] + [-1] * 3 + [6, 7, 8]
    assert sel.position.tolist() == want
    for g in (0, 3):  # nothing of an all-equal group reaches the loss
        assert float(sel.advantages[3 * g:3 * g + 3].abs().sum()) == 0.0
    # group 1 (0, 1, 0): (r - 1/3) / std, std = sqrt(1/3) (Bessel)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(sel.advantages[3:6], torch.tensor([-1 / 3 / s, 2 / 3 / s, -1 / 3 / s]), atol=1e-5,
                               rtol=1e-5)
    # group 4: rewards 1, 1 - 1, 1 -> (1/3, -2/3, 1/3) / std
    torch.testing.assert_close(sel.advantages[12:], torch.tensor([1 / 3 / s, -2 / 3 / s, 1 / 3 / s]), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(sel.shaping, torch.tensor([0.0] * 13 + [-1.0, 0.0]))
    # train_prompts 2: the batch takes the first two kept groups; group 4 is left out too.
    sel = dapo_selection(_ctx(DAPOConfig(train_prompts=2, overlong_buffer=2), 15, 3, 4), inputs)
    assert sel.position.tolist() == [-1] * 3 + [0, 1, 2, 3, 4, 5] + [-1] * 6 and sel.groups_trained == 2
    # Without dynamic sampling every group trains (the all-equal ones with advantage 0).
    sel = dapo_selection(_ctx(DAPOConfig(dynamic_sampling=False), 15, 3, 4), inputs)
    assert sel.position.tolist() == list(range(15)) and sel.groups_kept == 5


def test_dapo_overlong_filter_leaves_truncated_responses_out_of_the_loss():
    """Responses of gen_len tokens that do not end in EOS (id 63) were cut off: with overlong_filter their loss is
    masked (position -1, advantage 0), while their group's baseline still counts their reward."""
    inputs = _dapo_inputs([1.0, 0.0, 0.0, 1.0], [3, 3, 2, 3], 3)
    P = 2
    tokens = torch.tensor([[5, 6, 7, 8, 63], [5, 6, 7, 8, 9], [5, 6, 7, 63, 0], [5, 6, 63, 63, 63]])
    inputs["seq"].update(tokens=tokens, prompt_lens=torch.full((4,), P))
    ctx = dataclasses.replace(_ctx(DAPOConfig(overlong_filter=True), 4, 2, 3), eos_token_ids=(63,))
    sel = dapo_selection(ctx, inputs)
    # Row 1 (3 tokens ending in 9) is truncated; rows 0 and 3 end in EOS, row 2 stopped early.
    assert sel.position.tolist() == [0, -1, 2, 3] and sel.truncated_filtered == 1
    assert sel.in_trained_group.tolist() == [True] * 4
    # Groups (1, 0) and (0, 1): mean 0.5, Bessel std sqrt(1/2), so +-0.5 / sqrt(1/2); row 1's is masked.
    torch.testing.assert_close(sel.advantages, torch.tensor([0.5 / math.sqrt(0.5), 0.0, -0.5 / math.sqrt(0.5),
                                                             0.5 / math.sqrt(0.5)]), atol=1e-5, rtol=1e-5)
    off = dapo_selection(dataclasses.replace(ctx, config=DAPOConfig()), inputs)
    assert off.position.tolist() == [0, 1, 2, 3] and off.truncated_filtered == 0


def test_dapo_selection_on_one_dp_rank_numbers_its_rows_in_the_whole_batch():
    """Rank 1 of 2 (rows 6..11 of 12, groups of 3) with no model: its own flags only, so it sees groups 2 and 3;
    the all-reduce on a real dp group adds rank 0's (the e2e test runs that)."""
    inputs = _dapo_inputs([0.0, 1.0, 0.0, 2.0, 2.0, 2.0], [1] * 6, 2)
    sel = dapo_selection(_ctx(DAPOConfig(), 6, 3, 2, batch=12, start=6), inputs)
    assert sel.position.tolist() == [0, 1, 2, -1, -1, -1] and sel.groups_kept == 1


@pytest.mark.parametrize("cls, kw, match", [
    (DAPOConfig, {"train_prompts": 0}, "train_prompts must be a positive integer"),
    (DAPOConfig, {"train_prompts": 4, "dynamic_sampling": False}, "dynamic_sampling=False"),
    (DAPOConfig, {"overlong_buffer": -1}, "overlong_buffer must be"),
    (GRPOConfig, {"dual_clip": 1.0}, "dual_clip must be > 1"),
    (RLOOConfig, {"kl_estimator": "k4"}, "kl_estimator must be one of k1, k2, k3"),
    (PPOConfig, {"kl_placement": "both"}, "kl_placement must be 'reward'"),
    (PPOConfig, {"entropy_coef": -0.1}, "entropy_coef must be >= 0"),
    (GSPOConfig, {"clip_eps_high": 0.0}, "clip_eps_high must be positive"),
    (ReinforcePPConfig, {"gamma": 0.0}, "gamma must be in"),
])
def test_bad_settings_are_one_clear_error(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_defaults_follow_the_papers():
    assert (GRPOConfig().kl_estimator, GRPOConfig().kl_placement) == ("k3", "loss")
    assert (RLOOConfig().kl_estimator, RLOOConfig().kl_placement, PPOConfig().kl_placement) == ("k1", "reward", "reward")
    d = DAPOConfig()
    assert (d.clip_eps, d.eps_high, d.kl_coef, d.loss_norm) == (0.2, 0.28, 0.0, "token")
    g = GSPOConfig()
    assert (g.clip_eps, g.eps_high, g.loss_norm) == (3e-4, 4e-4, "sequence")


def test_show_refuses_dapo_settings_that_do_not_fit_the_experiment(capsys):
    exp = str(REPO / "experiments/dapo_tiny.py")
    assert main(["show", exp, "--set", "dapo.train_prompts=20"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dapo.train_prompts=20 exceeds the experiment's batch_size=12" in err[0], err
    assert "call 'actor_train'" in err[0], err
    assert main(["show", exp, "--set", "dapo.overlong_buffer=8"]) != 0
    err = capsys.readouterr().err
    assert "overlong_buffer=8 must be below gen_len=8" in err and "call 'actor_train'" in err, err
    # Issue 30, defect 6: clip-higher below clip_eps is refused, naming both.
    assert main(["show", exp, "--set", "dapo.clip_eps_high=0.1"]) != 0
    assert "clip_eps_high=0.1 is below clip_eps=0.2" in capsys.readouterr().err
    assert main(["show", exp, "--set", "dapo.dual_clip=0.5"]) != 0
    assert "dual_clip must be > 1" in capsys.readouterr().err


def test_estimator_prices_dapo_oversampling():
    """Generation, reward and reference cover the generation batch (96 prompts x 8); the train step the train batch
    (64 x 8): the same train-step cost as the graph that generates only 64 prompts, and more generation."""
    spec = load_experiment(str(REPO / "experiments/dapo_7b_7b.py"))
    exact = apply_overrides(spec, ["batch_size=64", "dapo.train_prompts=64"])
    over, fit = CostModel(build_graph(spec), discover=False), CostModel(build_graph(exact), discover=False)
    assert {c: over.workload(c).n_seqs for c in ("actor_gen", "rew_inf", "ref_inf", "actor_train")} == \
        {"actor_gen": 768, "rew_inf": 768, "ref_inf": 768, "actor_train": 128}
    assert fit.workload("actor_train") == over.workload("actor_train")
    mesh = spec.cluster.whole
    train = ("actor_train", mesh, ParallelStrategy(4, 2, 2), 8)
    assert over.call_cost(*train) == fit.call_cost(*train)
    gen = ("actor_gen", mesh, ParallelStrategy(4, 4, 1), 1)
    assert over.call_cost(*gen).time > 1.2 * fit.call_cost(*gen).time


@pytest.mark.parametrize("name", ["dapo_7b_7b", "gspo_7b_7b", "reinforce_pp_7b_7b"])
def test_dry_run_search_places_the_graph(name, capsys):
    assert main(["search", str(REPO / f"experiments/{name}.py"), "--dry-run", "--evals", "1500",
                 "--threads", "1"]) == 0
    table = capsys.readouterr().out.split("searched plan", 1)[1]
    for call in ("actor_gen", "rew_inf", "ref_inf", "actor_train"):
        assert f"\n{call} " in table, call
    assert "critic" not in table


def test_gspo_token_is_gspo_with_a_surrogate_per_token():
    """Issue 30, defect 6: GSPO-token (Zheng et al. 2025): s_i,t = sg[s_i] pi(y_t) / sg[pi(y_t)]. Against a
    hand-written formula in plain floats with per-token advantages (loss and gradient, some responses clipped), and
    equal to GSPO, loss and gradient, when the advantage is constant over each response (the paper's remark)."""
    import math

    import torch

    from realloc.algorithms.critic_free.pg_algorithms import GSPOConfig
    from realloc.algorithms.pg.pg_loss import LossOptions, policy_loss

    g = torch.Generator().manual_seed(7)
    n, T = 4, 5
    old = -torch.rand(n, T, generator=g) * 2
    logp0 = old + 0.15 * torch.randn(n, T, generator=g)
    mask = torch.ones(n, T, dtype=torch.bool)
    mask[1, 3:] = False
    w = torch.rand(n, T, generator=g) * mask
    adv = torch.randn(n, T, generator=g) * mask
    eps = 0.05
    token = LossOptions(eps_low=eps, eps_high=eps, sequence_ratio=True, token_level=True)
    logp = logp0.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, w, mask, token)
    loss.backward()
    want, grad, clipped = 0.0, [[0.0] * T for _ in range(n)], 0
    for i in range(n):
        toks = [t for t in range(T) if mask[i, t]]
        s = math.exp(sum(float(logp0[i, t] - old[i, t]) for t in toks) / len(toks))
        clipped += not 1 - eps <= s <= 1 + eps
        for t in toks:
            a, wt = float(adv[i, t]), float(w[i, t])
            plain, clip = -a * s, -a * min(max(s, 1 - eps), 1 + eps)
            want += wt * max(plain, clip)
            grad[i][t] = -a * wt * s if plain >= clip else 0.0  # d s_i,t / d logp_t = s_i
    assert float(loss) == pytest.approx(want, rel=1e-5) and 0 < clipped < n
    torch.testing.assert_close(logp.grad, torch.tensor(grad), rtol=1e-5, atol=1e-7)

    seq_adv = torch.randn(n, 1, generator=g) * mask  # constant over each response: GSPO's own case
    w_seq = (mask / mask.sum(dim=1, keepdim=True)).float()
    got = []
    for level in (False, True):
        lp = logp0.clone().requires_grad_(True)
        opts = LossOptions(eps_low=eps, eps_high=eps, sequence_ratio=True, token_level=level)
        out, _ = policy_loss(lp, old, seq_adv, w_seq, mask, opts)
        out.backward()
        got.append((out.detach(), lp.grad))
    torch.testing.assert_close(got[1][0], got[0][0])
    torch.testing.assert_close(got[1][1], got[0][1])
    assert GSPOConfig().token_level is False and GSPOConfig(token_level=True).token_level
