"""The optimizer steps of a critic-free policy-gradient train step (GRPO, RLOO, ReMax, REINFORCE++, DAPO, GSPO):
per-token advantages in, ``n_minibatches`` steps of the clipped loss with its options (``pg_loss.py``) out.

Layout invariance, as in PPO (``ppo_interfaces.py``): each trained sequence has a position in the train batch
(its global index, or its place among the sequences DAPO's dynamic sampling keeps), and mini-batch k is the set
of positions equal to k mod M, whatever the dp degree; the loss weights come from whole-mini-batch counts
all-reduced over dp, and the engine's dp gradient average is undone by weighting every micro-batch by dp.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from realloc.algorithms import losses
from realloc.algorithms.common import forward_batch, loss_mask, optimizer_step, response_columns
from realloc.algorithms.context import CallContext, Data, dp_all_reduce
from realloc.algorithms.pg import pg_loss
from realloc.algorithms.pg.decoupled import proximal_logprobs
from realloc.models.batch import split_batch


@dataclasses.dataclass
class StepsResult:
    sums: dict[str, float]  # means over the mini-batches of the weighted stats (already normalized)
    grad_norm: float  # mean over the mini-batches
    lr: float  # the first mini-batch's


def _padded(rows: torch.Tensor, n_mbs: int, fallback: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a mini-batch, padded with copies of row ``fallback`` (weight 0) to at least ``n_mbs`` rows: every
    dp rank must take part in every optimizer step, and every micro-batch needs a row, even where dynamic sampling
    left this rank none. Returns (rows, live) where ``live`` marks the real ones."""
    short = max(n_mbs - rows.numel(), 0)
    live = torch.cat([torch.ones(rows.numel(), dtype=torch.bool), torch.zeros(short, dtype=torch.bool)])
    return torch.cat([rows, torch.full((short,), fallback, dtype=torch.long)]), live


def policy_steps(ctx: CallContext, inputs: Data, adv: torch.Tensor, position: torch.Tensor | None = None,
                 sequence_ratio: bool = False) -> StepsResult:
    """Train the actor on this rank's rows with per-token advantages ``adv`` [n, T].

    ``position`` [n]: each row's place in the train batch, -1 for a row left out (dynamic sampling); None: its
    global index. The KL term of the loss is taken against ``ref_logp`` when the settings put it there."""
    model, cfg = ctx.model, ctx.config
    assert model is not None and ctx.optimizer is not None
    seq = inputs["seq"]
    mask = loss_mask(seq)  # the policy's tokens: a multi-turn rollout's environment tokens weigh 0
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    if position is None:
        position = torch.tensor(list(ctx.ids), dtype=torch.long)
    M = ctx.call.n_minibatches
    mb_of_row = torch.where(position >= 0, position % M, torch.full_like(position, -1))
    learns = mask.any(dim=1)  # a pending response (partial rollouts) has no loss tokens: it neither counts nor steps
    local = torch.stack([torch.stack([mask[mb_of_row == k].sum().double(), ((mb_of_row == k) & learns).sum().double()])
                         for k in range(M)])
    counts = dp_all_reduce(model, local)  # [M, (tokens, sequences)] of the whole mini-batches
    lrs = [cfg.lr_at(cfg.lr, ctx.iteration * M + k, ctx.schedule_steps) for k in range(M)]
    opts = pg_loss.loss_options(cfg, sequence_ratio=sequence_ratio)
    want_entropy = opts.entropy_coef > 0
    # decoupled objective: the log-probs under the parameters before this step, for mini-batches 1.. (0 runs on them)
    prox = proximal_logprobs(ctx, seq, mb_of_row) if cfg.decoupled else None
    sums: dict[str, float] = {}
    grad_norm = 0.0
    first = next((k for k in range(M) if counts[k, 1] > 0), 0)  # the first mini-batch that steps
    for k in range(M):
        if counts[k, 1] == 0:  # nothing to train on anywhere (dynamic sampling dropped it all): no step, not an
            continue           # Adam step of zero gradient that would still move the weights by its momentum
        for group in ctx.optimizer.param_groups:
            group["lr"] = lrs[k]
        rows, live = _padded(torch.nonzero(mb_of_row == k).view(-1), ctx.n_mbs, fallback=0)
        weights = losses.token_weights(mask[rows], cfg.loss_norm, float(counts[k, 0]), float(counts[k, 1]),
                                       ctx.gen_len) * live.view(-1, 1)
        mb = {**forward_batch({n: t[rows] for n, t in seq.items()}), "prompt_lens": seq["prompt_lens"][rows],
              "mask": mask[rows], "old_logp": logp[rows], "ref_logp": ref_logp[rows], "adv": adv[rows],
              "weights": weights}
        if prox is not None:
            mb["prox_logp"] = prox[rows]
        parts: list[dict[str, float]] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor], k: int = k) -> tuple[torch.Tensor, dict[str, float]]:
            new = response_columns(head.logprobs(cfg.temperature), m["prompt_lens"], m["mask"])
            ent = response_columns(head.entropy(cfg.temperature), m["prompt_lens"], m["mask"]) if want_entropy else None
            # before the first optimizer step the parameters are the proximal policy's: this forward's log-probs
            p = None if prox is None else (new.detach() if k == first else m["prox_logp"])
            loss, st = pg_loss.policy_loss(new, m["old_logp"], m["adv"], m["weights"], m["mask"], opts,
                                           ref_logp=m["ref_logp"], entropy=ent, prox_logp=p,
                                           behav_cap=cfg.behav_weight_cap,
                                           behav_cap_mode=cfg.behav_cap_mode)
            parts.append(st)
            return loss, {}

        grad_norm += optimizer_step(ctx, split_batch(mb, ctx.n_mbs), loss_fn) / M
        for p in parts:
            for name, v in p.items():
                sums[name] = sums.get(name, 0.0) + v / M
    return StepsResult(sums, grad_norm, lrs[0])


def actor_sums(steps: StepsResult, cfg: pg_loss.PGLossConfig) -> dict[str, float]:
    """The train step's reported stats under their metrics.jsonl names."""
    s = steps.sums
    out = {"actor_loss": s.get("loss", 0.0), "actor_clip_frac": s.get("clipped", 0.0),
           "approx_kl": s.get("approx_kl", 0.0)}
    if cfg.dual_clip is not None:
        out["actor_dual_clip_frac"] = s.get("dual_clipped", 0.0)
    if cfg.kl_in_loss:
        out[f"{cfg.kl_estimator}_kl"] = s.get("kl", 0.0)
    if cfg.entropy_coef:
        out["entropy"] = s.get("entropy", 0.0)
    if cfg.decoupled:
        out["behav_weight"], out["behav_capped"] = s.get("behav_weight", 0.0), s.get("behav_capped", 0.0)
    return out
