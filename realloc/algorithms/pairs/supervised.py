"""DPO and SFT on a ``ParallelModel`` (settings and declarations in ``dpo.py``).

Data (``realloc.data``): a ``pairs`` key holds ``chosen_tokens``/``rejected_tokens`` [n, P+T],
``prompt_lens`` [n] and ``chosen_mask``/``rejected_mask`` [n, T] (the ``seq`` layout twice, one prompt);
an SFT dataset supplies the ``seq`` layout itself. ``pair_logp`` holds the summed response log-probs
``chosen`` [n] and ``rejected`` [n].

Both train steps follow the layout-invariance rules of ``ppo_interfaces.py``: mini-batch k is the set of
pairs (sequences) whose global index is k mod M, normalizers are whole-mini-batch counts all-reduced
over dp, and every micro-batch is weighted by dp. A DPO micro-batch holds the chosen and the rejected
response of the same pairs (chosen rows first), since the loss needs both.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from realloc.algorithms import losses
from realloc.algorithms.common import forward_batch, optimizer_step, response_columns
from realloc.algorithms.context import CallContext, CallResult, Data, dp_all_reduce
from realloc.models.batch import split_batch
from realloc.strategy import even_ranges


def _both(pairs: Mapping[str, torch.Tensor], rows: torch.Tensor | slice) -> dict[str, torch.Tensor]:
    """The chosen responses of ``rows`` followed by their rejected ones, as one ``seq``-layout batch."""
    plen = pairs["prompt_lens"][rows]
    return {"tokens": torch.cat([pairs["chosen_tokens"][rows], pairs["rejected_tokens"][rows]]),
            "prompt_lens": torch.cat([plen, plen]),
            "gen_mask": torch.cat([pairs["chosen_mask"][rows], pairs["rejected_mask"][rows]])}


def _summed(logp_per_pos: torch.Tensor, seq: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs of a ``_both`` batch: (chosen [n], rejected [n])."""
    total = response_columns(logp_per_pos, seq["prompt_lens"], seq["gen_mask"]).sum(dim=1)
    n = total.shape[0] // 2
    return total[:n], total[n:]


def pair_logprobs(ctx: CallContext, inputs: Data) -> CallResult:
    """The reference model's summed log-probs of each pair's chosen and rejected response."""
    assert ctx.model is not None
    seq = _both(inputs["pairs"], slice(None))
    out = ctx.model.forward(forward_batch(seq), n_mbs=min(ctx.n_mbs, seq["tokens"].shape[0]), output="logprobs",
                            temperature=ctx.config.temperature)
    if out is None:
        return CallResult({}, {}, {})
    chosen, rejected = _summed(out.cpu(), seq)
    return CallResult({"ref_logp": {"chosen": chosen, "rejected": rejected}}, {}, {})


def _minibatches(ctx: CallContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(mini-batch of each local row, whole-mini-batch row counts all-reduced over dp)."""
    M = ctx.call.n_minibatches
    mb_of_row = torch.tensor([i % M for i in ctx.ids])
    counts = dp_all_reduce(ctx.model, torch.stack([(mb_of_row == k).sum().double() for k in range(M)]))
    return mb_of_row, counts


def _set_lr(ctx: CallContext, k: int) -> float:
    cfg, M = ctx.config, ctx.call.n_minibatches
    lr = cfg.lr_at(cfg.lr, ctx.iteration * M + k, ctx.schedule_steps)
    for group in ctx.optimizer.param_groups:
        group["lr"] = lr
    return lr


# (head, a micro-batch of pairs) -> (per-pair loss [n], the stats of these pairs as sums)
PairLoss = Callable[[Any, Mapping[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def pair_steps(ctx: CallContext, pairs: Mapping[str, torch.Tensor],
               per_rows: Callable[[torch.Tensor], dict[str, torch.Tensor]], pair_loss: PairLoss,
               stats: Sequence[str]) -> tuple[dict[str, float], float, float]:
    """The ``n_minibatches`` optimizer steps of a train step on preference pairs (DPO, reward models): mini-batch
    k is the pairs whose global index is k mod M, its loss the mean over its pairs of the whole batch (all dp
    ranks), each micro-batch the chosen and then the rejected responses of its pairs (``_both``) plus
    ``per_rows(rows)``. Returns (the ``stats`` as means over the pairs and mini-batches, the mean grad norm, the
    first mini-batch's learning rate)."""
    mb_of_row, counts = _minibatches(ctx)
    M = ctx.call.n_minibatches
    sums = dict.fromkeys(stats, 0.0)
    grad_norm, lr0 = 0.0, 0.0
    for k in range(M):
        lr = _set_lr(ctx, k)
        lr0 = lr if k == 0 else lr0
        rows = torch.nonzero(mb_of_row == k).view(-1)
        n_pairs = max(float(counts[k]), 1.0)
        micro = []
        for lo, hi in even_ranges(rows.numel(), min(ctx.n_mbs, rows.numel())):
            r = rows[lo:hi]
            seq = _both(pairs, r)
            micro.append({**forward_batch(seq), "prompt_lens": seq["prompt_lens"], "gen_mask": seq["gen_mask"],
                          **per_rows(r)})
        parts: list[dict[str, float]] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor], n_pairs: float = n_pairs
                    ) -> tuple[torch.Tensor, dict[str, float]]:
            per_pair, st = pair_loss(head, m)
            parts.append(st)
            return per_pair.sum() / n_pairs, {}

        grad_norm += optimizer_step(ctx, micro, loss_fn) / M
        for key in sums:
            sums[key] += sum(p[key] for p in parts) / n_pairs / M
    return sums, grad_norm, lr0


DPO_STATS = ("dpo_loss", "dpo_accuracy", "dpo_margin", "chosen_reward", "rejected_reward")


def dpo_train(ctx: CallContext, inputs: Data) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None and ctx.optimizer is not None
    ref = inputs["ref_logp"]

    def dpo_pair_loss(head: Any, m: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = _summed(head.logprobs(cfg.temperature), m)
        per_pair, st = losses.dpo_loss(chosen, rejected, m["ref_chosen"], m["ref_rejected"], cfg.beta,
                                       cfg.label_smoothing)
        return per_pair, {"dpo_loss": float(per_pair.detach().sum()),
                          "dpo_accuracy": float((st["margin"] > 0).double().sum()),
                          "dpo_margin": float(st["margin"].double().sum()),
                          "chosen_reward": float(st["chosen_reward"].double().sum()),
                          "rejected_reward": float(st["rejected_reward"].double().sum())}

    sums, grad_norm, lr0 = pair_steps(ctx, inputs["pairs"],
                                      lambda r: {"ref_chosen": ref["chosen"][r], "ref_rejected": ref["rejected"][r]},
                                      dpo_pair_loss, DPO_STATS)
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": grad_norm})
    return CallResult({}, sums, {"actor_grad_norm": grad_norm, "actor_lr": lr0})


def sft_train(ctx: CallContext, inputs: Data) -> CallResult:
    """Negative log-likelihood of the response tokens, averaged over the mini-batch's response tokens."""
    model = ctx.model
    assert model is not None and ctx.optimizer is not None
    seq = inputs["seq"]
    mask = seq["gen_mask"]
    M = ctx.call.n_minibatches
    mb_of_row = torch.tensor([i % M for i in ctx.ids])
    tokens = dp_all_reduce(model, torch.stack([mask[mb_of_row == k].sum().double() for k in range(M)]))
    sums = {"sft_loss": 0.0}
    grad_norm, lr0 = 0.0, 0.0
    for k in range(M):
        lr = _set_lr(ctx, k)
        lr0 = lr if k == 0 else lr0
        rows = torch.nonzero(mb_of_row == k).view(-1)
        weights = losses.token_weights(mask[rows], "token", float(tokens[k]), float(rows.numel()), ctx.gen_len)
        mb = {**forward_batch({n: t[rows] for n, t in seq.items()}), "prompt_lens": seq["prompt_lens"][rows],
              "mask": mask[rows], "weights": weights}
        parts: list[float] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            logp = response_columns(head.logprobs(), m["prompt_lens"], m["mask"])
            loss = losses.response_nll(logp, m["weights"])
            parts.append(float(loss.detach()))
            return loss, {}

        grad_norm += optimizer_step(ctx, split_batch(mb, min(ctx.n_mbs, rows.numel())), loss_fn) / M
        sums["sft_loss"] += sum(parts) / M
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": grad_norm})
    return CallResult({}, sums, {"actor_grad_norm": grad_norm, "actor_lr": lr0})
