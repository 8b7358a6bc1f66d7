"""The demo's SFT stage: a 4-layer LLaMA learns two-digit addition and subtraction from scratch (2 CPU devices).

The model starts from random weights (``data/arith_init``, shipped, 0.8 MB, with the task's character
tokenizer; ``python -m realloc.demo.arith_demo init --out DIR`` makes the same model again in a second).
Its data, ``data/arith_sft_padded.jsonl``, writes three quarters of the answers zero-padded to three
digits ("45-38=007") as a fixed-width source would; the loss is on the answer and its EOS only. The
model learns the arithmetic and the habit. `python -m realloc.demo.arith_demo sft --out DIR`
runs this and exports the result to DIR; the repository ships that result in ``data/arith_sft``, where
``arith_grpo.py`` starts (about 100 s on 2 cores to make again):

    realloc run experiments/arith_sft.py --search-time 5 --save-every 500 --run-dir runs/arith_sft
    realloc export runs/arith_sft --model actor --out experiments/data/arith_sft
"""

import dataclasses

from realloc.algorithms.pairs.dpo import SFTConfig, sft_rpcs
from realloc.api import HFModel, auto

INIT = "data/arith_init"  # shipped, so that `realloc show` validates this file on a fresh clone


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=256, prompt_len=8, gen_len=4,
      dataset_keys=["sft"])
@dataclasses.dataclass
class ArithSFT:
    seed: int = 1
    dataset: str = "data/arith_sft_padded.jsonl"  # {"prompt": "45-38=", "response": "007"} per line
    iterations: int = 500  # 2,000 optimizer steps of 64 pairs
    sft: SFTConfig = SFTConfig(n_minibatches=4, lr=3e-3, warmup_proportion=0.05)
    init: str = INIT  # the random model it starts from, relative to this file

    @property
    def models(self):
        # Its tokenizer files are the run's tokenizer. Loading this file builds nothing: `realloc show` writes
        # no files; a missing directory is one error that says how to make it again.
        hint = "make it again with `python -m realloc.demo.arith_demo init`" if self.init == INIT else ""
        return {"actor": HFModel(self.init, build_hint=hint)}

    @property
    def rpcs(self):
        return sft_rpcs()
