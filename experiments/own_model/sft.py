"""SFT of your own HuggingFace checkpoint on (prompt, answer) records, on 2 local CPU devices: the first stage of
docs/recipe-own-model-grpo.md; its export is where ``grpo.py`` starts (``--set actor=...``).

The records are the GRPO prompts' own: ``DataConfig(response_key="answer")`` trains on the answer (and EOS) after
each prompt.

    realloc run experiments/own_model/sft.py --search-time 5 --run-dir runs/own-sft
    realloc export runs/own-sft --model actor --out runs/own-sft-actor
"""

import dataclasses

from grpo import TINY

from realloc.algorithms.pairs.dpo import SFTConfig, sft_rpcs
from realloc.api import auto
from realloc.data.config import DataConfig


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=48, gen_len=8,
      dataset_keys=["sft"])
@dataclasses.dataclass
class OwnModelSFT:
    seed: int = 1
    iterations: int = 20
    dataset: str = "../data/text_prompts.jsonl"
    data: DataConfig = DataConfig(overflow="truncate", truncation_side="left", response_key="answer")
    sft: SFTConfig = SFTConfig(n_minibatches=2, lr=1e-4)
    actor: str = TINY

    @property
    def models(self):
        return {"actor": self.actor}

    @property
    def rpcs(self):
        return sft_rpcs()
