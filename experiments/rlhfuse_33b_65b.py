"""PPO with a LLaMA-33B actor and reference and a LLaMA-65B critic and reward model on 32 nodes of 8 Hopper GPUs:
one of RLHFuse's settings (rlhfuse.txt §7: batch 512, mini-batch 64, one gradient step per mini-batch), with a
long-tailed response length (lognormal, p99 12.8x the median; docs/long-tail.md "Planning the long tail").

``realloc search experiments/rlhfuse_33b_65b.py`` prints the searched plan with its long-tail migration beside
the best plan without one; ``benchmarks/bench_tail_plan.py`` runs every setting at 512, 1024 and 2048 tokens.
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import ResponseLengths, auto


@auto(nodelist="hopper[01-32]", n_devices_per_node=8, device="h100-80g", batch_size=512, prompt_len=256,
      gen_len=1024, response_lengths=ResponseLengths.lognormal(median=64, p99=820))
@dataclasses.dataclass
class RLHFuse33Bx65B:
    ppo: PPOConfig = PPOConfig(n_minibatches=8)
    dataset: str | None = None

    @property
    def rpcs(self):
        return ppo_rpcs(actor="llama-33b-4k", critic="llama-65b-4k-critic", n_minibatches=self.ppo.n_minibatches)
