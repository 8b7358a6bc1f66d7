"""SFT, a 7B model on one node of 8 A100s: the warm-start stage before RL.

256 (prompt, response) pairs per iteration, loss on the response tokens only (realloc/algorithms/pairs/dpo.py).
Export the result with `realloc export RUN --model actor --out DIR` and name DIR in an RL experiment's
`models`.
"""

import dataclasses

from realloc.algorithms.pairs.dpo import SFTConfig, sft_rpcs
from realloc.api import auto


@auto(nodelist="trainer01", n_devices_per_node=8, device="a100-80g", batch_size=256,
      prompt_len=1024, gen_len=1024, dataset_keys=["sft"])
@dataclasses.dataclass
class SFT7B:
    sft: SFTConfig = SFTConfig(n_minibatches=1, lr=1e-5)
    # Your pairs: {"prompt", "response"} or chat {"messages"} per line (.jsonl/.json/.parquet).
    dataset: str | None = None

    @property
    def rpcs(self):
        return sft_rpcs(actor="llama3-8b")
