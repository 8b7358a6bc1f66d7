"""PPO with the ``small`` model on the local CPU cluster: 2 gloo devices on localhost.

The same task as ``ppo_tiny.py`` (a rule rewards generated tokens from a target set), with
a larger model (hidden 256, 8 layers, 256-token vocabulary) and 24 generated tokens,
so that calls are dominated by compute (hundreds of milliseconds each) rather than by
per-call overheads, and where calls run matters: training the actor and the critic on
separate devices, data parallelism, or tensor parallelism over gloo give iteration times
that differ by several times. ``benchmarks/estimator_accuracy.py`` runs it under many
plans and compares the estimator with what runs.

Prompts are the tiny experiment's 8-token prompts (token ids below 64, valid here too).
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import auto

TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class SmallPPO:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"  # relative to this file
    iterations: int = 10
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=1e-3, critic_lr=1e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        # ppo_tiny.py spells the six calls out; they are the same here, with the small model
        return ppo_rpcs(actor="small", critic="small-critic", reward="rule", n_minibatches=self.ppo.n_minibatches,
                        reward_impl="rule_reward", reward_args={"rule": "token_set", "tokens": TARGET_TOKENS})
