"""Reward-model training (Bradley-Terry) on the arithmetic task's preference pairs, 2 CPU devices.

The reward model starts from the demo's SFT checkpoint (``data/arith_sft``, shipped) with a fresh scalar head
(``HFModel(..., new_value_head=True)``): its trunk already reads arithmetic, the head learns to score a right
answer above a wrong one (a near miss such as 81 for 80, or an operand copied from the question). It trains on
the 1,000 shipped pairs (``data/arith_pairs.jsonl``, made from SFT problems) and is evaluated every 50 iterations
on 480 of the 500 pairs over the held-out prompts (``data/arith_pairs_eval.jsonl``), which it never sees: metrics.jsonl
reports ``rm_accuracy`` / ``rm_margin`` / ``rm_loss`` of each step's batch and, under ``eval``, of the held-out
pairs. Then ``realloc export`` writes it as a LlamaForSequenceClassification checkpoint, the reward model of
``arith_ppo_rm.py``:

    realloc run experiments/arith_rm.py --search-time 5 --save-every 300 --run-dir runs/rm
    realloc export runs/rm --model reward --out runs/rm/reward-hf
    realloc run experiments/arith_ppo_rm.py --set reward_model=runs/rm/reward-hf --search-time 5
"""

import dataclasses

from realloc.algorithms.pairs.reward_model import RewardModelConfig, rm_rpcs
from realloc.api import HFModel, auto
from realloc.runtime.inputs.evaluation import EvalConfig

SFT = "data/arith_sft"  # shipped; `python -m realloc.demo.arith_demo sft --out experiments/data/arith_sft` re-makes it


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4,
      dataset_keys=["pairs"])
@dataclasses.dataclass
class ArithRewardModel:
    seed: int = 1
    dataset: str = "data/arith_pairs.jsonl"  # {"prompt": "45-38=", "chosen": "7", "rejected": "45"} per line
    tokenizer: str = "data/arith_tokenizer"
    iterations: int = 300  # 9,600 pairs: each shipped pair about 10 times
    rm: RewardModelConfig = RewardModelConfig(n_minibatches=2, lr=1e-3, lr_schedule="cosine", warmup_proportion=0.05)
    eval: EvalConfig = EvalConfig(dataset="data/arith_pairs_eval.jsonl", every=50, batches=15)  # 480 held-out pairs
    init: str = SFT

    @property
    def models(self):
        return {"reward": HFModel(self.init, new_value_head=True)}

    @property
    def rpcs(self):
        return rm_rpcs()
