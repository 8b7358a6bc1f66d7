"""DPO, 7B actor and its frozen 7B reference on 2 nodes of 8 A100s.

512 preference pairs per iteration, prompt up to 1024 tokens and responses up to 1024; the reference
scores each pair once, the actor takes the DPO step (realloc/algorithms/pairs/dpo.py). No generation.
"""

import dataclasses

from realloc.algorithms.pairs.dpo import DPOConfig, dpo_rpcs
from realloc.api import auto


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=512,
      prompt_len=1024, gen_len=1024, dataset_keys=["pairs"])
@dataclasses.dataclass
class DPO7B:
    dpo: DPOConfig = DPOConfig(n_minibatches=4, beta=0.1)
    # Your pairs: {"prompt", "chosen", "rejected"} per line (.jsonl/.json/.parquet, see realloc/data).
    # Set it here or per run with --set dataset=/abs/path/pairs.jsonl.
    dataset: str | None = None

    @property
    def rpcs(self):
        return dpo_rpcs(actor="llama3-8b")
