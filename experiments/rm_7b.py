"""Reward-model training (Bradley-Terry), a 7B model with a scalar head on 1 node of 8 A100s.

512 preference pairs per iteration, prompt up to 1024 tokens and responses up to 1024; each step scores both
responses of every pair at their last token and minimizes -log sigmoid(r_chosen - r_rejected)
(realloc/algorithms/pairs/reward_model.py). No generation and no second model: the search places one train step.
"""

import dataclasses

from realloc.algorithms.pairs.reward_model import RewardModelConfig, rm_rpcs
from realloc.api import auto


@auto(nodelist="trainer01", n_devices_per_node=8, device="a100-80g", batch_size=512,
      prompt_len=1024, gen_len=1024, dataset_keys=["pairs"])
@dataclasses.dataclass
class RewardModel7B:
    rm: RewardModelConfig = RewardModelConfig(n_minibatches=4, lr=9e-6, lr_schedule="cosine", warmup_proportion=0.03)
    # Your pairs: {"prompt", "chosen", "rejected"} per line (.jsonl/.json/.parquet, see realloc/data).
    # Set it here or per run with --set dataset=/abs/path/pairs.jsonl.
    dataset: str | None = None

    @property
    def rpcs(self):
        return rm_rpcs(model_type="llama3-8b-critic")
