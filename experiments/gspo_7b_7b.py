"""GSPO, 7B actor + 7B reward model on 2 nodes of 8 A100s (the appendix's 7B+7B cluster), no critic.

64 prompts per iteration, 8 responses each (512 sequences): group-normalized advantages, one length-normalized
importance ratio per response clipped at the sequence level (realloc/algorithms/critic_free/pg_algorithms.py), 4
optimizer steps per iteration so that the later ones are off-policy and the clipping matters.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.critic_free.pg_algorithms import GSPOConfig
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=64,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class GSPO7Bx7B:
    gspo: GSPOConfig = GSPOConfig(n_minibatches=4, lr=1e-6)
    # Your prompts (.jsonl/.json/.parquet, see realloc/data/prompts.py). Set it here or per run with
    # --set dataset=/abs/path/prompts.jsonl; `realloc run` refuses to start without it.
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("gspo", actor="llama3-8b", reward="llama3-8b-critic", n_samples=8)
