"""ReMax, 7B actor + 7B reward model on 2 nodes of 8 A100s, no critic.

512 prompts per iteration, one sampled and one greedy response each; the greedy response's reward is
the baseline (realloc/algorithms/critic_free/grpo.py). The greedy generation is a second GENERATE call the planner
places like any other.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import ReMaxConfig, critic_free_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=512,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class ReMax7Bx7B:
    remax: ReMaxConfig = ReMaxConfig(n_minibatches=4)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("remax", actor="llama3-8b", reward="llama3-8b-critic")
