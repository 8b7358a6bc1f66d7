"""PPO's rollout on multi-turn sequences: the policy's tokens are the steps of the episode.

In a multi-turn rollout (``critic_free/multiturn.py``) the response interleaves the policy's turns with the
environment's observations; ``seq["loss_mask"]`` marks the policy's tokens. The environment's tokens are not
actions: they are part of the state the next action sees. So the KL-shaped rewards and GAE (``ppo.py``) run over
each row's policy tokens alone, in order, as if the observations were not there: the score lands on the last
policy token, a value is the critic's estimate at a policy token (of the state before it, observations included),
and the advantage of the last token of one turn bootstraps from the value at the first token of the next turn.
``compact`` moves each row's policy tokens to the front, the unchanged ``ppo.py`` functions run on that prefix
mask, and ``expand`` puts the results back in place, zero on every environment token.
"""

from __future__ import annotations

import torch

from realloc.algorithms.ppo import ppo


def _order(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the masked positions first (in order), then the others: a permutation of the columns."""
    return torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's values at each row's masked positions moved to the front, zero after; that prefix mask)."""
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < mask.sum(dim=1, keepdim=True)
    return torch.gather(x, 1, _order(mask)) * prefix.to(x.dtype), prefix


def expand(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The inverse of ``compact``: the prefix of each row back at its masked positions, zero elsewhere."""
    return torch.zeros_like(packed).scatter(1, _order(mask), packed) * mask.to(packed.dtype)


def advantages(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor, kl_coef: float, estimator: str, gamma: float,
               lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [n, T] of PPO over the policy's tokens ``mask``; zero on every other token."""
    c_logp, prefix = compact(logp, mask)
    rewards, _ = ppo.kl_penalized_rewards(scores, c_logp, compact(ref_logp, mask)[0], prefix, kl_coef, estimator)
    adv, returns = ppo.gae(rewards, compact(values, mask)[0], prefix, gamma, lam)
    return expand(adv, mask), expand(returns, mask)
