"""GRPO on your own HuggingFace checkpoint with your own reward, on 2 local CPU devices: the recipe of
docs/recipe-own-model-grpo.md.

Swap ``actor`` (an HF directory: config.json, safetensors, tokenizer files) and ``dataset`` (JSONL or Parquet,
one ``{"prompt": ..., "answer": ...}`` per line) for your own, and ``my_reward.score`` for your reward. The
reward runs in the workers (``batch_reward``), or, with ``--set reward_url=...``, as a service over HTTP
(``remote_reward``; ``reward_server.py`` serves the same function).

By default the actor is a tiny random LLaMA with a BPE tokenizer trained on the shipped corpus, built into
``../data/hf_tiny/`` on first load (a few seconds; nothing is downloaded); ``sft.py`` fine-tunes it first:

    realloc show experiments/own_model/grpo.py
    realloc run experiments/own_model/grpo.py --search-time 5 --run-dir runs/own-grpo
"""

import dataclasses
from pathlib import Path

from my_reward import score  # a module beside the experiment file is importable, for the workers too

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import HFModel, auto
from realloc.data.config import DataConfig
from realloc.demo.demo_assets import demo_assets

TINY = str(demo_assets(Path(__file__).resolve().parent.parent / "data" / "hf_tiny")["sft"])


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=48, gen_len=8)
@dataclasses.dataclass
class OwnModelGRPO:
    seed: int = 1
    iterations: int = 20
    dataset: str = "../data/text_prompts.jsonl"  # relative to this file; the "answer" field goes to the reward
    data: DataConfig = DataConfig(overflow="truncate", truncation_side="left")
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=1e-4, kl_coef=0.01)
    sample_every: int = 5  # prompt -> response -> reward lines in RUN_DIR/samples.jsonl
    actor: str = TINY  # your checkpoint: an HF directory (relative to this file, or absolute)
    reward_url: str = ""  # "": my_reward.score in the workers; else the reward service at this URL

    @property
    def models(self):
        start = HFModel(self.actor)
        return {"actor": start, "ref": start}  # the reference is the starting point, frozen

    @property
    def rpcs(self):
        if self.reward_url:
            impl, args = "remote_reward", {"url": self.reward_url, "timeout": 30, "retries": 2}
        else:
            impl, args = "batch_reward", {"fn": score}
        # reward="rule": the reward call has no weights, it runs a function; 4 responses per prompt form a group
        return critic_free_rpcs("grpo", reward="rule", n_samples=4, reward_impl=impl, reward_args=args)
