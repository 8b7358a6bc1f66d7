"""REINFORCE++ on the tiny token-set task of ppo_tiny.py (2 CPU devices): no critic, no group.

One response per prompt; the rule rewards every generated token in a target set of 16 of the 64 token ids. The
KL to the reference is a per-token penalty in the reward; each token's advantage is its return-to-go,
normalized over the whole batch (Hu et al. 2025). Prompts are the 8-token ones of ppo_tiny.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.critic_free.pg_algorithms import ReinforcePPConfig
from realloc.api import auto

TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyReinforcePP:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"
    iterations: int = 30
    reinforce_pp: ReinforcePPConfig = ReinforcePPConfig(n_minibatches=2, lr=2e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return critic_free_rpcs("reinforce_pp", actor="tiny", reward="rule", n_samples=1, reward_impl="rule_reward",
                                reward_args={"rule": "token_set", "tokens": TARGET_TOKENS})
