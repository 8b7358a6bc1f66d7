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

from realloc.algorithms.common import forward_batch, loss_mask, optimizer_step, response_columns
from realloc.algorithms.context import CallContext, CallResult, Data, dp_all_reduce
from realloc.algorithms.pg import pg_loss
from realloc.algorithms.pg.decoupled import proximal_logprobs
from realloc.algorithms.ppo import policy_tokens, ppo
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
    ref_logp: torch.Tensor
    n_tokens: list[float]  # per mini-batch, over the whole batch


def _rollout(ctx: CallContext, inputs: Data, whiten: bool) -> _Rollout:
    cfg = ctx.config
    seq = inputs["seq"]
    mask = loss_mask(seq)  # the response, or a multi-turn rollout's policy tokens
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    values = inputs["values"]["values"]
    if "loss_mask" in seq:  # multi-turn: GAE over the policy's tokens alone (policy_tokens.py)
        adv, returns = policy_tokens.advantages(inputs["rewards"]["score"], logp, ref_logp, values, mask,
                                                cfg.kl_in_reward, cfg.kl_estimator, cfg.gamma, cfg.gae_lambda)
    else:
        rewards, _ = ppo.kl_penalized_rewards(inputs["rewards"]["score"], logp, ref_logp, mask, cfg.kl_in_reward,
                                              cfg.kl_estimator)
        adv, returns = ppo.gae(rewards, values, mask, cfg.gamma, cfg.gae_lambda)
    kl = (logp - ref_logp) * mask.to(logp.dtype)
    M = ctx.call.n_minibatches
    mb_of_row = torch.tensor([i % M for i in ctx.ids])
    local = torch.cat([ppo.masked_moments(adv, mask),
                       torch.stack([mask[mb_of_row == k].sum().double() for k in range(M)])])
    total = dp_all_reduce(ctx.model, local)
    if whiten:
        adv = ppo.whiten(adv, mask, total[:3])
    return _Rollout(seq, logp, values, mask, adv, returns, kl, ref_logp, [float(x) for x in total[3:]])


def _train(ctx: CallContext, inputs: Data, actor: bool) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None and ctx.optimizer is not None
    ro = _rollout(ctx, inputs, whiten=actor)
    M = ctx.call.n_minibatches
    loss_sum = clipped = approx_kl = grad_norm = 0.0
    extra: dict[str, float] = {}  # the actor's loss options' stats (pg_loss.policy_loss), means over mini-batches
    base_lr = cfg.lr if actor else cfg.critic_lr
    total_steps = ctx.schedule_steps
    lrs = [cfg.lr_at(base_lr, ctx.iteration * M + k, total_steps) for k in range(M)]
    decoupled = actor and cfg.decoupled
    prox = proximal_logprobs(ctx, ro.seq, torch.tensor([i % M for i in ctx.ids])) if decoupled else None
    for k in range(M):
        for group in ctx.optimizer.param_groups:
            group["lr"] = lrs[k]
        rows = torch.tensor([r for r, i in enumerate(ctx.ids) if i % M == k], dtype=torch.long)
        n_tok = max(ro.n_tokens[k], 1.0)
        mb = {**forward_batch({n: t[rows] for n, t in ro.seq.items()}),
              "prompt_lens": ro.seq["prompt_lens"][rows], "mask": ro.mask[rows], "old_logp": ro.old_logp[rows], "old_values": ro.old_values[rows],
              "advantages": ro.advantages[rows], "returns": ro.returns[rows], "ref_logp": ro.ref_logp[rows]}
        if prox is not None:
            mb["prox_logp"] = prox[rows]
        parts: list[ppo.LossStats] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor], k: int = k) -> tuple[torch.Tensor, dict[str, float]]:
            if actor:
                # decoupled: mini-batch 0 runs on the proximal parameters themselves (pg_train.py says why)
                loss, st = _actor_loss(head, m, cfg, n_tok, extra, proximal=None if prox is None else k > 0)
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
        sums.update(_option_sums(extra, cfg, M))
        sums["kl"] = float(ro.kl.double().sum()) / ctx.batch_size  # per sequence, summed over its tokens
        sums["adv_abs_mean"] = float((ro.advantages.abs() * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
    else:
        sums["value_mean"] = float((ro.old_values * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
        sums["return_mean"] = float((ro.returns * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
    return CallResult({}, sums, {f"{prefix}_grad_norm": grad_norm, f"{prefix}_lr": lrs[0]})


def _actor_loss(head: Any, m: Mapping[str, torch.Tensor], cfg: Any, n_tok: float, extra: dict[str, float],
                proximal: bool | None = None) -> tuple[torch.Tensor, ppo.LossStats]:
    """The clipped surrogate with the loss options (``pg_loss.py``: clip-higher, dual clip, entropy bonus, the KL
    in the loss), over the mini-batch's ``n_tok`` tokens; the options' stats are added to ``extra``."""
    opts = pg_loss.loss_options(cfg)
    new = response_columns(head.logprobs(cfg.temperature), m["prompt_lens"], m["mask"])
    ent = response_columns(head.entropy(cfg.temperature), m["prompt_lens"], m["mask"]) if opts.entropy_coef else None
    # decoupled (``proximal`` not None): the proximal log-probs are this forward's (mini-batch 0) or m's
    prox = None if proximal is None else (m["prox_logp"] if proximal else new.detach())
    loss, st = pg_loss.policy_loss(new, m["old_logp"], m["advantages"], m["mask"].to(new.dtype) / n_tok, m["mask"],
                                   opts, ref_logp=m["ref_logp"], entropy=ent, prox_logp=prox,
                                   behav_cap=cfg.behav_weight_cap,
                                   behav_cap_mode=cfg.behav_cap_mode)
    for k in ("kl", "entropy", "dual_clipped", "behav_weight", "behav_capped"):
        if k in st:
            extra[k] = extra.get(k, 0.0) + st[k]
    return loss, ppo.LossStats(loss_sum=st["loss"] * n_tok, clipped_tokens=st["clipped"] * n_tok,
                               approx_kl_sum=st["approx_kl"] * n_tok, n_tokens=float(m["mask"].sum()))


def _option_sums(extra: dict[str, float], cfg: Any, M: int) -> dict[str, float]:
    out = {}
    if cfg.dual_clip is not None:
        out["actor_dual_clip_frac"] = extra.get("dual_clipped", 0.0) / M
    if cfg.kl_in_loss:
        out[f"{cfg.kl_estimator}_kl"] = extra.get("kl", 0.0) / M
    if cfg.entropy_coef:
        out["entropy"] = extra.get("entropy", 0.0) / M
    if cfg.decoupled:
        out["behav_weight"] = extra.get("behav_weight", 0.0) / M
        out["behav_capped"] = extra.get("behav_capped", 0.0) / M
    return out


def actor_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, actor=True)


def critic_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, actor=False)
