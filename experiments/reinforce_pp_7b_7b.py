"""REINFORCE++-baseline, 7B actor + 7B reward model on 2 nodes of 8 A100s (the appendix's 7B+7B cluster), no critic.

128 prompts per iteration, 4 responses each (512 sequences, the PPO setting's batch): each response's reward minus
its group's mean, a per-token k1 KL penalty in the reward, return-to-go advantages normalized over the batch
(realloc/algorithms/critic_free/pg_algorithms.py). For plain REINFORCE++ (no group), use "reinforce_pp" with
n_samples=1 and batch_size=512.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.critic_free.pg_algorithms import ReinforcePPConfig
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=128,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class ReinforcePP7Bx7B:
    reinforce_pp: ReinforcePPConfig = ReinforcePPConfig(n_minibatches=4, lr=1e-6)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("reinforce_pp_baseline", actor="llama3-8b", reward="llama3-8b-critic", n_samples=4)
