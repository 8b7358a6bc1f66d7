"""GRPO on the arithmetic task with room to talk: lengths decided by the model's own EOS (issue 31 item 6).

The demo's GRPO (arith_grpo.py: the SFT checkpoint, 32 prompts x 8 answers, exact-match reward) with gen_len 16
instead of 4. The SFT model answers with one to three digits (or a zero-padded three) and EOS, so most responses
are 2-4 tokens; a sampled answer that misses its EOS runs on to gen_len. Nothing schedules the lengths: they come
from EOS, change as the policy learns, and every response is logged (``log_samples`` = the batch), so a later
``realloc search --lengths-from RUN_DIR`` prices the distribution the run produced (docs/long-tail.md).

    realloc run experiments/arith_grpo_eos.py --iterations 6 --run-dir runs/arith_eos
    realloc search experiments/arith_grpo_eos.py --lengths-from runs/arith_eos
    .venv/bin/python benchmarks/bench_eos_lengths.py     # estimate vs measured per call, lengths of the previous iteration

``--set grpo.partial_rollout_tokens=2 --set max_staleness=1`` cuts every response at 2 tokens and continues the
unfinished ones in the next iteration (docs/partial-rollouts.md).
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import HFModel, auto

EXACT_MATCH = {"rule": "exact_match", "field": "answer"}


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=16)
@dataclasses.dataclass
class ArithGRPOEOS:
    seed: int = 1
    dataset: str = "data/arith_train.jsonl"
    iterations: int = 6
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=5e-4, kl_coef=0.01, warmup_proportion=0.1)
    sample_every: int = 1
    log_samples: int = 256  # every response of the batch (32 prompts x 8): the lengths --lengths-from reads

    @property
    def models(self):
        start = HFModel("data/arith_sft")
        return {"actor": start, "ref": start}

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", reward="rule", n_samples=8,
                                reward_impl="verifiable_reward", reward_args=EXACT_MATCH)
