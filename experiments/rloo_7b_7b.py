"""RLOO, 7B actor + 7B reward model on 2 nodes of 8 A100s (the appendix's 7B+7B cluster), no critic.

64 prompts per iteration, 8 responses each (512 sequences, the PPO setting's batch), leave-one-out
baselines; the KL to the reference is part of the reward (realloc/algorithms/critic_free/grpo.py). A rule reward
instead of the model: model_type="rule", interface_impl="verifiable_reward" (realloc/algorithms/rewards/text_rules.py).
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import RLOOConfig, critic_free_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=64,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class RLOO7Bx7B:
    rloo: RLOOConfig = RLOOConfig(n_minibatches=4)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("rloo", actor="llama3-8b", reward="llama3-8b-critic", n_samples=8)
