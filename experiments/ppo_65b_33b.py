"""PPO, 65B actor/ref + 33B critic/reward (LLaMA-1 shapes) on 32 nodes of 8 Hopper GPUs: RLHFuse's 65B/33B setting
(rlhfuse.txt §7: 256 GPUs, global batch 512, mini-batches of 64, one optimizer step each). The dry run of fused
actor and critic training (docs/fused-training.md, "Searched fusion")."""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-32]", n_devices_per_node=8, device="h100-80g", batch_size=512,
      prompt_len=512, gen_len=1024)
@dataclasses.dataclass
class PPO65Bx33B:
    ppo: PPOConfig = PPOConfig(n_minibatches=8)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama-65b", critic="llama-33b-critic", n_minibatches=self.ppo.n_minibatches)
