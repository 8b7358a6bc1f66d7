"""PPO, 7B actor + 7B critic on 2 nodes of 8 A100s: the setting of realhf-appendix.txt Tables 4-6.

The appendix's "7B" is the LLaMA-3-8B shape of its Table 1.
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=512,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class PPO7Bx7B:
    ppo: PPOConfig = PPOConfig(n_minibatches=8)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama3-8b", critic="llama3-8b-critic", n_minibatches=self.ppo.n_minibatches)
