"""The tool demo's no-tool arm: GRPO on the same multiplication, answered directly (2 CPU devices).

The actor starts from the SFT stage trained on direct answers (``calc_sft.py --set
dataset=data/calc_sft_direct.jsonl``) when ``init`` names its export; the ``exact_match`` rule scores the
response's first number against the record's ``answer``. Without ``init``, random weights (model type "tiny").

    realloc run experiments/calc_grpo_direct.py --search-time 5 --set init=runs/calc_demo/sft_direct
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import HFModel, auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=16, prompt_len=8, gen_len=6)
@dataclasses.dataclass
class CalcGRPODirect:
    seed: int = 1
    dataset: str = "data/calc_train.jsonl"
    tokenizer: str = "data/calc_tokenizer"
    iterations: int = 100
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=5e-4, kl_coef=0.01, temperature=0.8)
    init: str = ""

    @property
    def models(self):
        return {"actor": HFModel(self.init), "ref": HFModel(self.init)} if self.init else {}

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", actor=None if self.init else "tiny", reward="rule", n_samples=8,
                                reward_impl="verifiable_reward", reward_args={"rule": "exact_match", "field": "answer"})
