"""PPO, 7B actor/ref + 34B critic/reward on 4 nodes of 8 A100s (realhf.txt section 8.1)."""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-04]", n_devices_per_node=8, device="a100-80g", batch_size=512,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class PPO7Bx34B:
    ppo: PPOConfig = PPOConfig(n_minibatches=8)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama3-8b", critic="llama3-34b-critic", n_minibatches=self.ppo.n_minibatches)
