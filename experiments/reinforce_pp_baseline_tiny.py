"""REINFORCE++-baseline on the tiny token-set task of ppo_tiny.py (2 CPU devices): no critic, 4 responses per
prompt.

Each response's reward minus the mean reward of its prompt's group, then REINFORCE++'s per-token KL in the
reward, return-to-go and batch-wide normalization (Hu et al. 2025). The rule rewards every generated token in a
target set of 16 of the 64 token ids. Prompts are the 8-token ones of ppo_tiny.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.critic_free.pg_algorithms import ReinforcePPConfig
from realloc.api import auto

TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyReinforcePPBaseline:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"
    iterations: int = 30
    reinforce_pp: ReinforcePPConfig = ReinforcePPConfig(n_minibatches=2, lr=2e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return critic_free_rpcs("reinforce_pp_baseline", actor="tiny", reward="rule", n_samples=4,
                                reward_impl="rule_reward", reward_args={"rule": "token_set", "tokens": TARGET_TOKENS})
