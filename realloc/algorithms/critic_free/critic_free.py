"""The train step of GRPO, RLOO and ReMax (settings in ``grpo.py``): a sequence-level advantage per response,
then the clipped surrogate over its tokens with the loss options of ``pg_loss.py``, in ``n_minibatches``
optimizer steps (``pg_train.py``, which also says why any plan takes the same steps).

The KL to the reference goes where ``kl_placement`` says: subtracted from each response's reward (its summed
``kl_estimator`` estimate x ``kl_coef``) before the baseline, or added to the loss per token. Advantages need
each prompt's whole group on one rank: plans give every call a dp that divides the number of prompts, so a dp rank's
sequences are whole groups (``DataflowGraph.dp_error``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from realloc.algorithms import losses
from realloc.algorithms.common import loss_mask
from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.algorithms.critic_free.pg_train import actor_sums, policy_steps
from realloc.algorithms.pg import pg_loss

# (ctx, inputs, the KL each response's reward pays [n]: 0 when the KL is in the loss) -> [n]
Advantages = Callable[[CallContext, Data, torch.Tensor], torch.Tensor]


def _group(ctx: CallContext, n: int) -> int:
    g = ctx.group_size
    ids = list(ctx.ids)  # a range, or a row list (token-balanced dp ranks): whole groups, ascending
    assert n % g == 0 and all(i == ids[j - j % g] + j % g and ids[j - j % g] % g == 0 for j, i in enumerate(ids)), \
        "a dp rank must hold whole groups of responses"
    return g


def grpo_advantages(ctx: CallContext, inputs: Data, seq_kl: torch.Tensor) -> torch.Tensor:
    score = inputs["rewards"]["score"] - ctx.config.kl_coef * seq_kl
    return losses.group_advantages(score, _group(ctx, score.numel()), scale=ctx.config.scale_rewards)


def rloo_advantages(ctx: CallContext, inputs: Data, seq_kl: torch.Tensor) -> torch.Tensor:
    score = inputs["rewards"]["score"] - ctx.config.kl_coef * seq_kl
    return losses.leave_one_out_advantages(score, _group(ctx, score.numel()))


def remax_advantages(ctx: CallContext, inputs: Data, seq_kl: torch.Tensor) -> torch.Tensor:
    # The greedy response to the same prompt is sequence i of the greedy call (one response per prompt).
    return inputs["rewards"]["score"] - ctx.config.kl_coef * seq_kl - inputs["greedy_rewards"]["score"]


def reward_kl(cfg: Any, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n]: each response's summed KL estimate (``kl_estimator``) when the settings put the KL in the reward, else 0."""
    if not cfg.kl_in_reward:
        return torch.zeros(logp.shape[0], dtype=logp.dtype)
    return (pg_loss.kl_estimate(logp, ref_logp, cfg.kl_estimator) * mask.to(logp.dtype)).sum(dim=1)


def _train(ctx: CallContext, inputs: Data, advantages: Advantages) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None
    mask = loss_mask(inputs["seq"])
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    adv_seq = advantages(ctx, inputs, reward_kl(cfg, logp, ref_logp, mask))
    steps = policy_steps(ctx, inputs, adv_seq.view(-1, 1).to(logp.dtype) * mask)
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": steps.grad_norm})
    sums = actor_sums(steps, cfg)
    seq_kl = losses.sequence_kl(logp, ref_logp, mask)
    sums["kl"] = float(seq_kl.double().sum()) / ctx.batch_size  # per sequence, summed over its tokens
    sums["adv_abs_mean"] = float(adv_seq.abs().double().sum()) / ctx.batch_size
    return CallResult({}, sums, {"actor_grad_norm": steps.grad_norm, "actor_lr": steps.lr})


def grpo_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, grpo_advantages)


def rloo_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, rloo_advantages)


def remax_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, remax_advantages)
