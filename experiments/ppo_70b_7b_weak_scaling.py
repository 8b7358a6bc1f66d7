"""PPO at the 128-GPU point of the paper's weak scaling (realhf-appendix.txt section A): 70B actor/ref + 7B
critic/reward on 16 nodes of 8 A100s with batch 4096 (7B on 16 GPUs with batch 512, ..., 70B on 128 with 4096),
context 2048 with prompts of 1024, the batch split into 8 PPO mini-batches. The models are Table 1's LLaMA-3
shapes (vocabulary 128256).

The authors ran the heuristic plan here at TP 8 / PP 4 / DP 4 with 8 micro-batches. realloc's heuristic takes the
same layout but needs more micro-batches and activation recomputation to fit its engine's memory;
docs/performance.md, "Weak scaling at 70B", says why.
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-16]", n_devices_per_node=8, device="a100-80g", batch_size=4096,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class PPO70Bx7BWeakScaling:
    ppo: PPOConfig = PPOConfig(n_minibatches=8)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama3-70b", critic="llama3-8b-critic", n_minibatches=self.ppo.n_minibatches)
