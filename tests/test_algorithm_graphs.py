"""The critic-free and DPO graphs as the planner sees them, and Dr. GRPO's loss normalization.

- ``realloc search --dry-run`` on the GPU-scale GRPO, ReMax and DPO experiments prints the searched
  plan and the baselines, and no baseline places a call the graph does not have (no critic);
- the estimator counts ``batch_size x n_samples`` sequences for every call of a group-sampling graph
  (and two rows per DPO pair): the same work, time and transfer cost as the same graph written with
  ``batch_size x n_samples`` prompts and one response each;
- ``GRPOConfig.dr_grpo()``'s loss and gradient on a small group, against hand values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from realloc.algorithms import losses
from realloc.algorithms.context import CallContext
from realloc.algorithms.critic_free.critic_free import grpo_advantages
from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.api import load_experiment
from realloc.cli import main
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.search import baseline
from realloc.search.baselines import BASELINES
from realloc.strategy import ParallelStrategy

from hf_assets import REPO

GPU_EXPERIMENTS = {"grpo_7b_7b": ("actor_gen", "rew_inf", "ref_inf", "actor_train"),
                   "remax_7b_7b": ("actor_gen", "rew_inf", "ref_inf", "actor_greedy", "rew_greedy", "actor_train"),
                   "dpo_7b": ("ref_inf", "actor_train")}


@pytest.mark.parametrize("name", sorted(GPU_EXPERIMENTS))
def test_dry_run_search_prints_the_plan_and_baselines_and_no_baseline_has_a_critic(name, capsys):
    experiment = str(REPO / "experiments" / f"{name}.py")
    assert main(["search", experiment, "--dry-run", "--evals", "1500", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "searched plan" in text and "estimated time per iteration" in text
    table = text.split("searched plan", 1)[1]
    for call in GPU_EXPERIMENTS[name]:
        assert f"\n{call} " in table, call
    for row in BASELINES:
        assert f"\n{row} " in table, row
    assert "critic" not in table
    spec = load_experiment(experiment)
    graph = build_graph(spec)
    assert not any(i.name == "ppo_critic" for i in graph.interfaces.values())
    for row in BASELINES:
        if name == "dpo_7b" and row == "split":  # no generating model: the split baseline does not apply
            assert "split                 n/a  (the split baseline needs a generating model" in table
            continue
        plan = baseline(spec, row)
        assert set(plan.placements) == set(GPU_EXPERIMENTS[name]), row


def _one_response_each(spec):
    """The same graph with batch_size x n_samples prompts and one response per prompt. Its train step runs GRPO's
    function declared without GRPO's minimum group of 2 (only its cost is compared, nothing runs)."""
    import types

    from realloc.algorithms.registry import builtin_interfaces
    from realloc.api import TRAIN_STEP

    g = spec.group_size
    flat = dataclasses.replace(builtin_interfaces()[("grpo_actor", TRAIN_STEP)], name="flat_grpo", min_group_size=1)
    rpcs = tuple(dataclasses.replace(r, n_samples=1, interface_impl="flat_grpo" if r.is_train else r.interface_impl)
                 for r in spec.rpcs)
    return dataclasses.replace(spec, batch_size=spec.batch_size * g, rpcs=rpcs,
                               config=types.SimpleNamespace(grpo=spec.config.grpo, interfaces=[flat]))


def test_estimator_counts_batch_times_n_samples_sequences_downstream_of_group_sampling():
    spec = load_experiment(str(REPO / "experiments/grpo_7b_7b.py"))
    assert (spec.batch_size, spec.group_size, spec.call("actor_train").n_minibatches) == (64, 8, 4)
    grouped, flat = CostModel(build_graph(spec), discover=False), CostModel(build_graph(_one_response_each(spec)),
                                                                            discover=False)
    # 64 prompts x 8 responses = 512 sequences for every call; the train step takes 4 mini-batches of 128.
    want = {"actor_gen": 512, "rew_inf": 512, "ref_inf": 512, "actor_train": 128}
    assert {c: grouped.workload(c).n_seqs for c in want} == want
    mesh = spec.cluster.whole
    for call, strategy, n_mbs in (("actor_gen", ParallelStrategy(4, 4, 1), 1), ("rew_inf", ParallelStrategy(16, 1, 1), 2),
                                  ("ref_inf", ParallelStrategy(8, 2, 1), 8), ("actor_train", ParallelStrategy(4, 2, 2), 8)):
        assert grouped.workload(call) == flat.workload(call)
        assert grouped.call_cost(call, mesh, strategy, n_mbs) == flat.call_cost(call, mesh, strategy, n_mbs), call
    a = (spec.cluster.mesh("trainer01"), ParallelStrategy(2, 4, 1))  # generation on one node, the reward on the
    b = (spec.cluster.mesh("trainer02"), ParallelStrategy(8, 1, 1))  # other: all 512 sequences cross
    assert grouped.data_transfer_cost("actor_gen", "rew_inf", a, b) == flat.data_transfer_cost("actor_gen", "rew_inf",
                                                                                               a, b) > 0
    # DPO: a pair is two rows through the model (chosen and rejected): 512 pairs -> 1024 rows, 4 mini-batches.
    dpo = CostModel(build_graph(load_experiment(str(REPO / "experiments/dpo_7b.py"))), discover=False)
    assert (dpo.workload("ref_inf").n_seqs, dpo.workload("actor_train").n_seqs) == (1024, 256)


def _ctx(cfg: GRPOConfig, n: int, group: int, gen_len: int) -> CallContext:
    return CallContext(call=None, model=None, optimizer=None, config=cfg, prompt_len=4, gen_len=gen_len, seed=0,
                       iteration=0, ids=range(n), batch_size=n, n_mbs=1, group_size=group)


def _loss_and_grad(cfg: GRPOConfig, scores: torch.Tensor, mask: torch.Tensor, gen_len: int):
    """The critic-free train step's loss for ``cfg`` at ratio 1 (new = old log-probs), as critic_free.py builds it."""
    n = scores.numel()
    adv = grpo_advantages(_ctx(cfg, n, n, gen_len), {"rewards": {"score": scores}}, torch.zeros(n))
    weights = losses.token_weights(mask, cfg.loss_norm, float(mask.sum()), float(n), gen_len)
    logp = torch.zeros(mask.shape, requires_grad=True)
    loss, _ = losses.clipped_pg_loss(logp, torch.zeros(mask.shape), adv.view(-1, 1) * mask, weights, cfg.clip_eps)
    loss.backward()
    return float(loss.detach()), logp.grad


def test_dr_grpo_normalization_against_hand_values():
    dr = GRPOConfig.dr_grpo(lr=1e-5)
    assert (dr.scale_rewards, dr.loss_norm, dr.lr) == (False, "constant", 1e-5)
    # One group of 4 responses of 2, 3, 1 and 4 tokens (gen_len 4); only the first is right.
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    lens = torch.tensor([2, 3, 1, 4])
    mask = torch.arange(4).view(1, 4) < lens.view(4, 1)
    # Dr. GRPO: A_i = r_i - mean = (0.75, -0.25, -0.25, -0.25), loss = -sum_i A_i |o_i| / (gen_len * G)
    #   = -(1.5 - 0.75 - 0.25 - 1.0) / 16 = 0.5 / 16; d loss / d logp_it = -A_i / 16 on every valid token.
    loss, grad = _loss_and_grad(dr, scores, mask, gen_len=4)
    assert loss == pytest.approx(0.5 / 16)
    want = torch.tensor([0.75, -0.25, -0.25, -0.25]).view(4, 1) * mask / -16
    torch.testing.assert_close(grad, want)
    # GRPO: A_i divided by the group's std (Bessel: 0.5) -> (1.5, -0.5, -0.5, -0.5), each response's loss the
    # mean over its own tokens, then the mean over responses: loss = -(1.5 - 1.5) / 4 = 0 and
    # d loss / d logp_it = -A_i / (|o_i| * 4): a short response's tokens weigh more.
    loss, grad = _loss_and_grad(GRPOConfig(), scores, mask, gen_len=4)
    assert loss == pytest.approx(0.0, abs=1e-6)
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5]).view(4, 1)
    torch.testing.assert_close(grad, -adv * mask / (lens.view(4, 1) * 4), atol=1e-5, rtol=1e-5)


def test_remax_advantages_against_hand_values():
    """ReMax: a response's reward minus kl_coef x its summed log-ratio to the reference, minus the greedy response's
    reward for the same prompt (sequence i of the greedy call)."""
    from realloc.algorithms.critic_free.critic_free import remax_advantages
    from realloc.algorithms.critic_free.grpo import ReMaxConfig

    cfg = ReMaxConfig(kl_coef=0.5)
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5], [-3.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.7, -1.0], [-0.4, -0.8, -0.2], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    # Summed log-ratios over the valid tokens: 0.5 - 0.3 = 0.2 (the masked -8 left out), -0.1 + 0.3 - 0.3 = -0.1, -1.
    seq_kl = losses.sequence_kl(logp, ref, mask)
    torch.testing.assert_close(seq_kl, torch.tensor([0.2, -0.1, -1.0]))
    inputs = {"rewards": {"score": torch.tensor([1.0, 0.0, 2.0])},
              "greedy_rewards": {"score": torch.tensor([0.5, 0.5, 2.0])}}
    adv = remax_advantages(_ctx(cfg, 3, 1, 3), inputs, seq_kl)
    # 1 - 0.5 * 0.2 - 0.5 = 0.4;  0 - 0.5 * (-0.1) - 0.5 = -0.45;  2 - 0.5 * (-1) - 2 = 0.5
    torch.testing.assert_close(adv, torch.tensor([0.4, -0.45, 0.5]))
