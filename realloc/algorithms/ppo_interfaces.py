"""PPO's train steps (realhf.txt §2.1, Figure 1) on a ``ParallelModel``: GAE, whitening, clipped losses.

The data layout of the keys is in ``common.py``.

Layout invariance. Mini-batch k is the set of sequences whose global index is k mod M, whatever
the dp degree; advantages are whitened with batch-wide moments and losses are divided by the
mini-batch's global token count (both all-reduced over dp), and the engine's dp gradient
average is undone by weighting every micro-batch by dp. Hence any plan takes the same optimizer
steps as a single device would, up to floating-point rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from realloc.algorithms import ppo
from realloc.algorithms.common import forward_batch, optimizer_step, response_columns
from realloc.algorithms.context import CallContext, CallResult, Data, dp_all_reduce
from realloc.algorithms.decoupled import decoupled_pg_loss, proximal_logprobs
from realloc.models.batch import split_batch


# -- training --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Rollout:
    seq: Mapping[str, torch.Tensor]
    old_logp: torch.Tensor
    old_values: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor  # whitened with batch-wide moments
    returns: torch.Tensor
    kl: torch.Tensor  # [n, T] logp - ref_logp on valid tokens
    n_tokens: list[float]  # per mini-batch, over the whole batch


def _rollout(ctx: CallContext, inputs: Data, whiten: bool) -> _Rollout:
    cfg = ctx.config
    seq = inputs["seq"]
    mask = seq["gen_mask"]
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    values = inputs["values"]["values"]
    rewards, kl = ppo.kl_penalized_rewards(inputs["rewards"]["score"], logp, ref_logp, mask, cfg.kl_coef)
    adv, returns = ppo.gae(rewards, values, mask, cfg.gamma, cfg.gae_lambda)
    M = ctx.call.n_minibatches
    mb_of_row = torch.tensor([i % M for i in ctx.ids])
    local = torch.cat([ppo.masked_moments(adv, mask),
                       torch.stack([mask[mb_of_row == k].sum().double() for k in range(M)])])
    total = dp_all_reduce(ctx.model, local)
    if whiten:
        adv = ppo.whiten(adv, mask, total[:3])
    return _Rollout(seq, logp, values, mask, adv, returns, kl, [float(x) for x in total[3:]])


def _train(ctx: CallContext, inputs: Data, actor: bool) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None and ctx.optimizer is not None
    ro = _rollout(ctx, inputs, whiten=actor)
    M = ctx.call.n_minibatches
    loss_sum = clipped = approx_kl = grad_norm = 0.0
    base_lr = cfg.lr if actor else cfg.critic_lr
    total_steps = ctx.schedule_steps
    lrs = [cfg.lr_at(base_lr, ctx.iteration * M + k, total_steps) for k in range(M)]
    decoupled = actor and cfg.decoupled
    prox = proximal_logprobs(ctx, ro.seq, torch.tensor([i % M for i in ctx.ids])) if decoupled else None
    behav = [0.0, 0.0]  # the decoupled objective's importance weight and capped share, token means
    for k in range(M):
        for group in ctx.optimizer.param_groups:
            group["lr"] = lrs[k]
        rows = torch.tensor([r for r, i in enumerate(ctx.ids) if i % M == k], dtype=torch.long)
        n_tok = max(ro.n_tokens[k], 1.0)
        mb = {**forward_batch({n: t[rows] for n, t in ro.seq.items()}),
              "prompt_lens": ro.seq["prompt_lens"][rows], "mask": ro.mask[rows], "old_logp": ro.old_logp[rows], "old_values": ro.old_values[rows],
              "advantages": ro.advantages[rows], "returns": ro.returns[rows]}
        if prox is not None:
            mb["prox_logp"] = prox[rows]
        parts: list[ppo.LossStats] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor], k: int = k) -> tuple[torch.Tensor, dict[str, float]]:
            if decoupled:
                new = response_columns(head.logprobs(cfg.temperature), m["prompt_lens"], m["mask"])
                # mini-batch 0 runs on the proximal parameters themselves (critic_free.py says why)
                p = new.detach() if k == 0 else m["prox_logp"]
                w = m["mask"].to(new.dtype) / n_tok
                loss, d = decoupled_pg_loss(new, p, m["old_logp"], m["advantages"], w, cfg.clip_eps,
                                            cfg.behav_weight_cap)
                st = ppo.LossStats(loss_sum=d["loss"] * n_tok, clipped_tokens=d["clipped"] * n_tok,
                                   approx_kl_sum=d["approx_kl"] * n_tok, n_tokens=float(m["mask"].sum()))
                behav[0] += d["behav_weight"] / M
                behav[1] += d["behav_capped"] / M
            elif actor:
                new = response_columns(head.logprobs(cfg.temperature), m["prompt_lens"], m["mask"])
                loss, st = ppo.actor_loss(new, m["old_logp"], m["advantages"], m["mask"], cfg.clip_eps, n_tok)
            else:
                new = response_columns(head.values, m["prompt_lens"], m["mask"], shift=-1)
                loss, st = ppo.critic_loss(new, m["old_values"], m["returns"], m["mask"], cfg.value_clip_eps, n_tok)
            parts.append(st)
            return loss, {}

        grad_norm += optimizer_step(ctx, split_batch(mb, ctx.n_mbs), loss_fn) / M
        loss_sum += sum(p.loss_sum for p in parts) / n_tok / M
        clipped += sum(p.clipped_tokens for p in parts) / n_tok / M
        approx_kl += sum(p.approx_kl_sum for p in parts) / n_tok / M
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": grad_norm})
    prefix = "actor" if actor else "critic"
    sums = {f"{prefix}_loss": loss_sum, f"{prefix}_clip_frac": clipped}
    if actor:
        sums["approx_kl"] = approx_kl
        sums["kl"] = float(ro.kl.double().sum()) / ctx.batch_size  # per sequence, summed over its tokens
        sums["adv_abs_mean"] = float((ro.advantages.abs() * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
        if decoupled:
            sums["behav_weight"], sums["behav_capped"] = behav
    else:
        sums["value_mean"] = float((ro.old_values * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
        sums["return_mean"] = float((ro.returns * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
    return CallResult({}, sums, {f"{prefix}_grad_norm": grad_norm, f"{prefix}_lr": lrs[0]})


def actor_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, actor=True)


def critic_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, actor=False)
