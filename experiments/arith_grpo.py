"""GRPO on the arithmetic task from the demo's SFT checkpoint (2 CPU devices): what `make demo` runs.

The actor and its frozen reference start from ``data/arith_sft``, the SFT stage's checkpoint as shipped
(``python -m realloc.demo.arith_demo sft --out experiments/data/arith_sft`` re-makes it through realloc,
about 100 s on 2 cores: see arith_sft.py). For each of 32 prompts per iteration the actor
samples 8 answers; the ``exact_match`` rule scores an answer 1 when its number is the prompt's
``answer`` as written ("7", not "007") and 0 otherwise; group-normalized advantages (no critic) and a
k3 KL term to the reference drive the update. Every 5 iterations metrics.jsonl gets the greedy
accuracy on 128 held-out prompts (``eval``).

    realloc run experiments/arith_grpo.py --search-time 5 --save-every 40 --run-dir runs/arith_demo
    realloc export runs/arith_demo --model actor --out runs/arith_demo/actor-hf
    python -m realloc.demo.accuracy runs/arith_demo/actor-hf experiments/data/arith_eval.jsonl
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import HFModel, auto
from realloc.runtime.inputs.evaluation import EvalConfig

EXACT_MATCH = {"rule": "exact_match", "field": "answer"}  # realloc/algorithms/rewards/text_rules.py
SFT = "data/arith_sft"  # shipped (0.8 MB); re-made by the command below


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4)
@dataclasses.dataclass
class ArithGRPO:
    seed: int = 1
    dataset: str = "data/arith_train.jsonl"  # {"prompt": "1+63=", "answer": "64"} per line
    iterations: int = 40
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=5e-4, kl_coef=0.01, warmup_proportion=0.1)
    eval: EvalConfig = EvalConfig(dataset="data/arith_eval.jsonl", every=5, greedy=True, batches=4)
    sample_every: int = 5
    # Where the actor starts: the SFT stage's export, relative to this file (if it is deleted, `realloc show`
    # says the directory does not exist and how to make it again).
    init: str = SFT

    @property
    def models(self):
        hint = ("make it again with `python -m realloc.demo.arith_demo sft --out experiments/data/arith_sft` (the "
                "SFT stage through realloc, about 100 s on 2 cores)") if self.init == SFT else ""
        start = HFModel(self.init, build_hint=hint)
        return {"actor": start, "ref": start}

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", reward="rule", n_samples=8,
                                reward_impl="verifiable_reward", reward_args=EXACT_MATCH)
