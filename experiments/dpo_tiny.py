"""DPO on arithmetic preference pairs (the right answer over a near miss) with the tiny model on 2 CPU devices.

The actor and its frozen reference start from the same random weights (model_type "tiny", same seed),
so every pair's margin starts at 0; the reference scores each pair once per iteration and the actor
takes the DPO step. metrics.jsonl reports the preference accuracy (pairs with a positive margin) and
the mean margin. A random model has to learn some arithmetic to prefer the right answer over a near
miss, so on the 1,000 shipped pairs (``data/arith_pairs.jsonl``, from ``python -m realloc.tools.arith_task
data``) the loss falls slowly (0.69 -> ~0.64 in 20 iterations); on 64 pairs seen again and again
(tests/test_algorithms_e2e.py) accuracy rises from ~0.3 to ~0.8 in 12. The tokenizer is built into
data/arith/ on first use.

    realloc run experiments/dpo_tiny.py --search-time 5
"""

import dataclasses

from realloc.algorithms.dpo import DPOConfig, dpo_rpcs
from realloc.api import auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4,
      dataset_keys=["pairs"])
@dataclasses.dataclass
class TinyDPO:
    seed: int = 1
    dataset: str = "data/arith_pairs.jsonl"  # {"prompt": "45-38=", "chosen": "7", "rejected": "8"} per line
    tokenizer: str = "data/arith_tokenizer"
    iterations: int = 20
    dpo: DPOConfig = DPOConfig(n_minibatches=2, lr=3e-3, beta=0.1)

    @property
    def rpcs(self):
        return dpo_rpcs(actor="tiny")
