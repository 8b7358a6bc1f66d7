"""The tool demo's SFT stage: the tiny model learns to multiply through a calculator tool from a few traces.

The model starts from random weights (model type "tiny"). Its data, ``data/calc_sft_tool.jsonl``, are 1,000
conversations: ``123*45=`` -> ``<c>123*45</c>`` EOS ``<r>5535</r>5535`` (the call, the tool's answer as ToolEnv
writes it, the final answer). The loss covers the whole response, the tool's answer included; the model learns
the format and the copying, not the multiplication. ``--set dataset=data/calc_sft_direct.jsonl`` trains the
no-tool arm of the demo on the same problems answered directly (``123*45=`` -> ``5535``).
``python -m realloc.demo.calc_demo`` runs both, then GRPO on each (calc_grpo_tool.py, calc_grpo_direct.py):

    realloc run experiments/calc_sft.py --search-time 5 --save-every 100 --run-dir runs/calc_sft
"""

import dataclasses

from realloc.algorithms.pairs.dpo import SFTConfig, sft_rpcs
from realloc.api import auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=64, prompt_len=8, gen_len=32,
      dataset_keys=["sft"])
@dataclasses.dataclass
class CalcSFT:
    seed: int = 1
    dataset: str = "data/calc_sft_tool.jsonl"
    tokenizer: str = "data/calc_tokenizer"  # one token per character (shipped)
    iterations: int = 300
    sft: SFTConfig = SFTConfig(n_minibatches=1, lr=3e-3, warmup_proportion=0.05)

    @property
    def rpcs(self):
        return sft_rpcs(actor="tiny")
