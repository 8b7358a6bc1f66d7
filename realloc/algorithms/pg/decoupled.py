"""The decoupled PPO objective of asynchronous RL (AReaL: Fu et al. 2025, §5.2 "Decoupled PPO objective").

With bounded staleness the responses a train step learns from were sampled by an older policy, the
*behaviour* policy pi_behav (the generation's log-probs). The decoupled objective separates it from the
*proximal* policy pi_prox that the trust region is taken around: the parameters before this train step's
first update (the current version). Per token, with A the advantage,

    w = pi_prox / pi_behav                      (importance weight, capped at ``cap``: see below)
    r = pi_theta / pi_prox                      (the ratio PPO clips)
    loss_t = w * max(-A r, -A clip(r, 1 - eps, 1 + eps))

When the responses are on-policy (staleness 0 and the generation's log-probs equal the train step's),
pi_prox = pi_behav, w = 1 and this is the standard clipped surrogate. The cap keeps a token the behaviour
policy found far less likely than the proximal one from dominating a step, in one of two ways
(``behav_cap_mode``): "truncate" (the default) uses ``min(w, cap)``, truncated importance sampling (IMPALA's
rho-bar); "mask" gives such a token weight 0, as AReaL's ``behav_imp_weight_cap`` does (its loss keeps only
tokens with ``w <= cap``). Truncation keeps a bounded gradient from those tokens; masking drops them.

The loss itself is ``pg_loss.policy_loss`` with ``prox_logp`` (so every loss option applies to it too); this
module computes the proximal log-probs.
"""

from __future__ import annotations

from typing import Mapping

import torch

from realloc.algorithms.common import forward_batch, response_columns
from realloc.algorithms.context import CallContext


def proximal_logprobs(ctx: CallContext, seq: Mapping[str, torch.Tensor], mb_of_row: torch.Tensor) -> torch.Tensor:
    """[n, T] log-probs of the responses under the parameters before this train step (the decoupled
    objective's proximal policy), for the rows of mini-batches 1.. (mini-batch 0 takes them from its own
    forward); zeros elsewhere, and on pipeline stages other than the last (which computes no loss)."""
    mask = seq["gen_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    rows = torch.nonzero(mb_of_row > 0).view(-1)  # -1: a row no mini-batch trains (dynamic sampling)
    if rows.numel() == 0:
        return out
    assert ctx.model is not None
    part = {n: t[rows] for n, t in seq.items()}
    with torch.no_grad():
        lp = ctx.model.forward(forward_batch(part), n_mbs=min(ctx.n_mbs, rows.numel()), output="logprobs",
                               temperature=ctx.config.temperature)
    if lp is not None:
        out[rows] = response_columns(lp.cpu(), part["prompt_lens"], part["gen_mask"]).to(out.dtype)
    return out
