"""GRPO of an 8B LLaMA-3 with an 8B reward model: training on a node of 8 H100s, with a node of 8 H20s beside
it (``grpo_h100_l40s.py``: 8 L40Ss), over a slower link between the two (100 Gb/s Ethernet) -- what users
of RL frameworks ask for (NVIDIA-NeMo/RL issue #824; docs/heterogeneous.md). The search chooses which calls
run on which pool. Generation may run one train step ahead (``max_staleness=1``, asynchronous RL), so that
the generation pool works while the training pool trains; the strongest pool alone gets the same choice.

    realloc search experiments/grpo_h100_h20.py
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import Pool, auto

LINK = dict(pool_link_bandwidth=12.5e9, pool_link_latency=5e-5)  # 100 Gb/s RoCE between the pools


@auto(pools=[Pool("h100-01", "h100-80g", 8), Pool("h20-01", "h20-96g", 8)], batch_size=64, prompt_len=1024,
      gen_len=1024, max_staleness=1, **LINK)
@dataclasses.dataclass
class GRPOH100H20:
    grpo: GRPOConfig = GRPOConfig(n_minibatches=4, lr=1e-6)
    dataset: str | None = None

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", actor="llama3-8b", reward="llama3-8b-critic", n_samples=8)

