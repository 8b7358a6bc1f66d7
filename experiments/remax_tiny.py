"""ReMax on the tiny token-set task of ppo_tiny.py (2 CPU devices): no critic; each prompt gets one sampled
and one greedy response, and the greedy response's reward is the sampled one's baseline.

The rule rewards every generated token in a target set of 16 of the 64 token ids. Prompts are the 8-token
ones of ppo_tiny.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import ReMaxConfig, critic_free_rpcs
from realloc.api import auto

TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyReMax:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"
    iterations: int = 30
    remax: ReMaxConfig = ReMaxConfig(n_minibatches=2, lr=2e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return critic_free_rpcs("remax", actor="tiny", reward="rule", reward_impl="rule_reward",
                                reward_args={"rule": "token_set", "tokens": TARGET_TOKENS})
