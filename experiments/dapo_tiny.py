"""DAPO on the tiny token-set task of ppo_tiny.py (2 CPU devices): no critic, 4 responses per prompt.

The reward is binary, as DAPO's verifiable rewards are: 1 when at least 3 of a response's tokens are in a target
set of 16 of the 64 token ids (about a third of the random model's responses), else 0. So whole groups often
score alike (all 0 at first, all 1 later); dynamic sampling drops them and refills the train batch of 8 groups
from the 12 prompts generated per iteration. Clip-higher (0.2 / 0.28), a token-level loss, no KL. The overlong
penalty is off (``overlong_buffer`` 0): the random tiny model never samples its EOS, so every response is 8
tokens and the penalty would be the same for all. Prompts are the 8-token ones of ppo_tiny.
"""

import dataclasses

import torch

from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig
from realloc.api import auto

TARGET_TOKENS = list(range(16, 32))


def three_in_set(prompt_tokens, response_tokens, response_mask, tokens):
    """1.0 when at least 3 valid response tokens are in ``tokens``, else 0.0."""
    hit = torch.isin(response_tokens, torch.as_tensor(tokens, dtype=response_tokens.dtype)) & response_mask
    return (hit.sum(dim=1) >= 3).float()


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=12, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyDAPO:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"
    iterations: int = 30
    dapo: DAPOConfig = DAPOConfig(n_minibatches=2, lr=2e-3, train_prompts=8)

    @property
    def rpcs(self):
        return critic_free_rpcs("dapo", actor="tiny", reward="rule", n_samples=4, reward_impl="rule_reward",
                                reward_args={"rule": three_in_set, "tokens": TARGET_TOKENS})
