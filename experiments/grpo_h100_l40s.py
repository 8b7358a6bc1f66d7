"""``grpo_h100_h20.py`` with a node of 8 L40Ss (48 GB, PCIe, no NVLink) beside the 8 H100s instead of H20s.

    realloc search experiments/grpo_h100_l40s.py
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import Pool, auto

LINK = dict(pool_link_bandwidth=12.5e9, pool_link_latency=5e-5)  # 100 Gb/s RoCE between the pools


@auto(pools=[Pool("h100-01", "h100-80g", 8), Pool("l40s-01", "l40s-48g", 8)], batch_size=64, prompt_len=1024,
      gen_len=1024, max_staleness=1, **LINK)
@dataclasses.dataclass
class GRPOH100L40S:
    grpo: GRPOConfig = GRPOConfig(n_minibatches=4, lr=1e-6)
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", actor="llama3-8b", reward="llama3-8b-critic", n_samples=8)
