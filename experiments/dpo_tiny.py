"""DPO on arithmetic preference pairs (the right answer over a wrong one) with the tiny model on 2 CPU devices.

The actor and its frozen reference start from the same random weights (model_type "tiny", same seed),
so every pair's margin starts at 0 (loss log 2 = 0.693); the reference scores each pair once per
iteration and the actor takes the DPO step. metrics.jsonl reports the preference accuracy (pairs of the
batch with a positive margin, before the step) and the mean margin. The data are 64 pairs
(``data/arith_pairs_small.jsonl``), each seen ten times in 20 iterations: enough for a random model to
learn to rank them. Measured with the command below (5 s of search, 20 to 40 s in all on our shared
2-core machine): preference accuracy 0.38 -> 1.00 (0.91 or more from iteration 8 on), loss
0.691 -> 0.085, mean margin 0.02 -> 3.3. What it shows is the DPO step at work, not arithmetic: a random
model does not learn to add in a minute, and on all 1,000 shipped pairs (``--set
dataset=data/arith_pairs.jsonl``, each seen under once) the accuracy only wanders between 0.5 and 0.8.

    realloc run experiments/dpo_tiny.py --search-time 5
"""

import dataclasses

from realloc.algorithms.pairs.dpo import DPOConfig, dpo_rpcs
from realloc.api import auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4,
      dataset_keys=["pairs"])
@dataclasses.dataclass
class TinyDPO:
    seed: int = 1
    dataset: str = "data/arith_pairs_small.jsonl"  # {"prompt": "45-38=", "chosen": "7", "rejected": "8"} per line
    tokenizer: str = "data/arith_tokenizer"  # the task's character tokenizer (shipped)
    iterations: int = 20
    # beta 0.5 rather than the usual 0.1: a larger step in the implicit reward per unit of log-prob margin, so
    # the ranking shows in a short run.
    dpo: DPOConfig = DPOConfig(n_minibatches=2, lr=3e-3, beta=0.5)

    @property
    def rpcs(self):
        return dpo_rpcs(actor="tiny")
