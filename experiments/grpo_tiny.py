"""GRPO on the tiny token-set task of ppo_tiny.py (2 CPU devices): no critic, 4 responses per prompt.

The rule rewards every generated token in a target set of 16 of the 64 token ids; the group-normalized
advantage needs no value model. Prompts are the 8-token ones of ppo_tiny.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import auto

TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyGRPO:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"
    iterations: int = 30
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=2e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=4, reward_impl="rule_reward",
                                reward_args={"rule": "token_set", "tokens": TARGET_TOKENS})
