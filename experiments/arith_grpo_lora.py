"""LoRA GRPO on the arithmetic task from the demo's SFT checkpoint (2 CPU devices).

``arith_grpo.py`` with the actor's base frozen: rank-8 LoRA adapters on every projection of its blocks are all
that trains (39k parameters next to the 0.2M-parameter base, with their AdamW state), and the reference is the
actor's own base with the adapters switched off (``reference_from_base``), so the graph has no reference model
to load, place or reallocate.

    realloc run experiments/arith_grpo_lora.py --search-time 5 --save-every 40 --run-dir runs/arith_lora
    realloc export runs/arith_lora --model actor --out runs/arith_lora/actor-hf            # merged
    realloc export runs/arith_lora --model actor --format peft --out runs/arith_lora/peft  # adapters only
    python -m realloc.demo.accuracy runs/arith_lora/actor-hf experiments/data/arith_eval.jsonl
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import HFModel, LoRAConfig, auto, reference_from_base
from realloc.runtime.inputs.evaluation import EvalConfig

EXACT_MATCH = {"rule": "exact_match", "field": "answer"}  # realloc/algorithms/rewards/text_rules.py
SFT = "data/arith_sft"  # shipped (0.8 MB)


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4)
@dataclasses.dataclass
class ArithGRPOLoRA:
    seed: int = 1
    dataset: str = "data/arith_train.jsonl"
    iterations: int = 40
    # adapters learn with a larger step than full fine-tuning (B starts at zero)
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=5e-3, kl_coef=0.01, warmup_proportion=0.1)
    lora: LoRAConfig = LoRAConfig(rank=8, alpha=16)
    eval: EvalConfig = EvalConfig(dataset="data/arith_eval.jsonl", every=5, greedy=True, batches=4)
    sample_every: int = 5
    init: str = SFT

    @property
    def models(self):
        return {"actor": HFModel(self.init)}

    @property
    def rpcs(self):
        return reference_from_base(critic_free_rpcs("grpo", reward="rule", n_samples=8,
                                                    reward_impl="verifiable_reward", reward_args=EXACT_MATCH))
