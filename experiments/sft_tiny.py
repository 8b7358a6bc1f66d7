"""SFT on the arithmetic task's (prompt, answer) pairs with the tiny 4-layer model on 2 CPU devices.

The model starts from random weights (model_type "tiny", a 64-token vocabulary over the task's 18-token
character tokenizer); the loss is the negative log-likelihood of the answer and its EOS only, the prompt
is context. The loss falls from ~4 (uniform over the vocabulary) within a few iterations. The tokenizer
is the task's, shipped in data/arith_tokenizer/.

    realloc run experiments/sft_tiny.py --search-time 5
"""

import dataclasses

from realloc.algorithms.pairs.dpo import SFTConfig, sft_rpcs
from realloc.api import auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4,
      dataset_keys=["sft"])
@dataclasses.dataclass
class TinySFT:
    seed: int = 1
    dataset: str = "data/arith_sft.jsonl"  # {"prompt": "45-38=", "response": "7"} per line
    tokenizer: str = "data/arith_tokenizer"
    iterations: int = 20
    sft: SFTConfig = SFTConfig(n_minibatches=2, lr=3e-3)

    @property
    def rpcs(self):
        return sft_rpcs(actor="tiny")
