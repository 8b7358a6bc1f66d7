"""PPO of a 33B LLaMA on 8 A100-80G plus 8 V100-32G: the setting of FlexRLHF's Table III
(flexrlhf-placement.txt; docs/heterogeneous.md).

All four models are LLaMA-1 33B; actor and critic train rank-4 LoRA adapters, as in the paper (input 256
tokens, 256 generated). The A100s are one node of 8; the V100s two nodes of 4 (the paper's "2 x 4 V100"),
which have no bf16 and compute in fp16. The link between the pools is the V100 pool's inter-node link
(100 Gb/s), the default. ``realloc search experiments/ppo_33b_a100_v100.py`` prints the two-pool plan next
to the best plan on the A100s alone.
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import LoRAConfig, Pool, auto


@auto(pools=[Pool("a100-01", "a100-80g", 8), Pool("v100-[01-02]", "v100-32g", 4)], batch_size=64,
      prompt_len=256, gen_len=256)
@dataclasses.dataclass
class PPO33BA100V100:
    ppo: PPOConfig = PPOConfig(n_minibatches=1)  # FlexRLHF: one PPO epoch, one batch per rollout
    lora: LoRAConfig = LoRAConfig(rank=4, alpha=8, models=("actor", "critic"))
    dataset: str | None = None

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama-33b", critic="llama-33b-critic", n_minibatches=self.ppo.n_minibatches)
