"""DAPO, 7B actor + 7B reward model on 2 nodes of 8 A100s (the appendix's 7B+7B cluster), no critic.

96 prompts generated per iteration, 8 responses each (768 sequences); dynamic sampling trains on the first 64
groups whose rewards differ (512 sequences, the GRPO setting's batch), so the plan pays for half as much
generation, reward and reference inference again as GRPO's (realloc/algorithms/critic_free/pg_algorithms.py).
Clip-higher, token-level loss, no KL, the overlong penalty over the last 256 of the 1024 response tokens.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=96,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class DAPO7Bx7B:
    dapo: DAPOConfig = DAPOConfig(n_minibatches=4, lr=1e-6, train_prompts=64, overlong_buffer=256)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("dapo", actor="llama3-8b", reward="llama3-8b-critic", n_samples=8)
