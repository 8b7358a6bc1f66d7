"""The train step of GRPO, RLOO and ReMax (settings in ``grpo.py``): a sequence-level advantage per response,
then the clipped surrogate over its tokens, in ``n_minibatches`` optimizer steps.

Layout invariance, as in PPO (``ppo_interfaces.py``): mini-batch k is the set of sequences whose global
index is k mod M; the loss weights come from whole-mini-batch counts all-reduced over dp; the engine's dp
gradient average is undone by weighting every micro-batch by dp. Advantages need each prompt's whole
group on one rank: plans give every call a dp that divides the number of prompts, so a dp rank's
sequences are whole groups (``DataflowGraph.dp_error``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from realloc.algorithms import losses
from realloc.algorithms.common import forward_batch, optimizer_step, response_columns
from realloc.algorithms.context import CallContext, CallResult, Data, dp_all_reduce
from realloc.algorithms.decoupled import decoupled_pg_loss, proximal_logprobs
from realloc.models.batch import split_batch

Advantages = Callable[[CallContext, Data, torch.Tensor], torch.Tensor]  # (ctx, inputs, seq KL [n]) -> [n]


def _group(ctx: CallContext, n: int) -> int:
    g = ctx.group_size
    assert n % g == 0 and ctx.ids.start % g == 0, "a dp rank must hold whole groups of responses"
    return g


def grpo_advantages(ctx: CallContext, inputs: Data, seq_kl: torch.Tensor) -> torch.Tensor:
    score = inputs["rewards"]["score"]
    return losses.group_advantages(score, _group(ctx, score.numel()), scale=ctx.config.scale_rewards)


def rloo_advantages(ctx: CallContext, inputs: Data, seq_kl: torch.Tensor) -> torch.Tensor:
    score = inputs["rewards"]["score"] - ctx.config.kl_coef * seq_kl
    return losses.leave_one_out_advantages(score, _group(ctx, score.numel()))


def remax_advantages(ctx: CallContext, inputs: Data, seq_kl: torch.Tensor) -> torch.Tensor:
    # The greedy response to the same prompt is sequence i of the greedy call (one response per prompt).
    return inputs["rewards"]["score"] - ctx.config.kl_coef * seq_kl - inputs["greedy_rewards"]["score"]


def _train(ctx: CallContext, inputs: Data, advantages: Advantages, kl_in_loss: bool) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None and ctx.optimizer is not None
    seq = inputs["seq"]
    mask = seq["gen_mask"]
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    seq_kl = losses.sequence_kl(logp, ref_logp, mask)
    adv_seq = advantages(ctx, inputs, seq_kl)
    adv = adv_seq.view(-1, 1).to(logp.dtype) * mask
    M = ctx.call.n_minibatches
    mb_of_row = torch.tensor([i % M for i in ctx.ids])
    local = torch.stack([torch.stack([mask[mb_of_row == k].sum().double(), (mb_of_row == k).sum().double()])
                         for k in range(M)])
    counts = dp_all_reduce(model, local)  # [M, (tokens, sequences)] of the whole mini-batches
    total_steps = ctx.schedule_steps
    lrs = [cfg.lr_at(cfg.lr, ctx.iteration * M + k, total_steps) for k in range(M)]
    sums = {"actor_loss": 0.0, "actor_clip_frac": 0.0, "approx_kl": 0.0, "k3_kl": 0.0}
    prox = proximal_logprobs(ctx, seq, mb_of_row) if cfg.decoupled else None
    if cfg.decoupled:
        sums.update(behav_weight=0.0, behav_capped=0.0)
    grad_norm = 0.0
    for k in range(M):
        for group in ctx.optimizer.param_groups:
            group["lr"] = lrs[k]
        rows = torch.nonzero(mb_of_row == k).view(-1)
        weights = losses.token_weights(mask[rows], cfg.loss_norm, float(counts[k, 0]), float(counts[k, 1]),
                                       ctx.gen_len)
        mb = {**forward_batch({n: t[rows] for n, t in seq.items()}), "prompt_lens": seq["prompt_lens"][rows],
              "mask": mask[rows], "old_logp": logp[rows], "ref_logp": ref_logp[rows], "adv": adv[rows],
              "weights": weights}
        if prox is not None:
            mb["prox_logp"] = prox[rows]
        parts: list[dict[str, float]] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor], k: int = k) -> tuple[torch.Tensor, dict[str, float]]:
            new = response_columns(head.logprobs(cfg.temperature), m["prompt_lens"], m["mask"])
            ref = m["ref_logp"] if kl_in_loss else None
            if not cfg.decoupled:
                loss, st = losses.clipped_pg_loss(new, m["old_logp"], m["adv"], m["weights"], cfg.clip_eps, ref,
                                                  cfg.kl_coef)
            else:
                # Before the first optimizer step the parameters are the proximal policy's: its log-probs are
                # this forward's, with no pass of their own (later mini-batches use proximal_logprobs').
                p = new.detach() if k == 0 else m["prox_logp"]
                loss, st = decoupled_pg_loss(new, p, m["old_logp"], m["adv"], m["weights"], cfg.clip_eps,
                                             cfg.behav_weight_cap, ref, cfg.kl_coef)
            parts.append(st)
            return loss, {}

        grad_norm += optimizer_step(ctx, split_batch(mb, ctx.n_mbs), loss_fn) / M
        sums["actor_loss"] += sum(p["loss"] for p in parts) / M
        sums["actor_clip_frac"] += sum(p["clipped"] for p in parts) / M
        sums["approx_kl"] += sum(p["approx_kl"] for p in parts) / M
        sums["k3_kl"] += sum(p["k3_kl"] for p in parts) / M
        if cfg.decoupled:
            sums["behav_weight"] += sum(p["behav_weight"] for p in parts) / M
            sums["behav_capped"] += sum(p["behav_capped"] for p in parts) / M
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": grad_norm})
    sums["kl"] = float(seq_kl.double().sum()) / ctx.batch_size  # per sequence, summed over its tokens
    sums["adv_abs_mean"] = float(adv_seq.abs().double().sum()) / ctx.batch_size
    if not kl_in_loss:
        del sums["k3_kl"]
    return CallResult({}, sums, {"actor_grad_norm": grad_norm, "actor_lr": lrs[0]})


def grpo_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, grpo_advantages, kl_in_loss=True)


def rloo_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, rloo_advantages, kl_in_loss=False)


def remax_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, remax_advantages, kl_in_loss=False)
