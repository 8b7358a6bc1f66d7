"""PPO from HuggingFace checkpoints on text prompts, on 2 local CPU devices: the "your own model and data" path.

Swap the paths in ``models`` (and ``dataset``) for your own: an SFT checkpoint for the actor, the
reference and the critic (with a fresh value head), and a sequence-classification reward model.

The demo's checkpoints are tiny random LLaMAs with a BPE tokenizer trained on the shipped corpus,
built into ``data/hf_tiny/`` the first time this file is loaded (a few seconds; nothing is
downloaded). Their rewards mean nothing; the run shows the path from HF directories and text
prompts to an exported HF checkpoint:

    realloc show experiments/ppo_hf_tiny.py
    realloc run experiments/ppo_hf_tiny.py --search-time 5 --export-every 10 --run-dir runs/hf
    realloc export runs/hf --model actor --out runs/hf/actor-hf
"""

import dataclasses
from pathlib import Path

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import HFModel, auto
from realloc.data.config import DataConfig
from realloc.demo.demo_assets import demo_assets

ASSETS = demo_assets(Path(__file__).parent / "data" / "hf_tiny")


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=16, prompt_len=48, gen_len=16)
@dataclasses.dataclass
class HFTinyPPO:
    seed: int = 1
    iterations: int = 10
    dataset: str = "data/text_prompts.jsonl"  # {"prompt": "..."} per line; relative to this file
    tokenizer: str = str(ASSETS["tokenizer"])  # by default the actor's checkpoint directory would be used
    data: DataConfig = DataConfig(overflow="truncate", truncation_side="left")
    sample_every: int = 5  # decoded prompt -> response -> reward lines in RUN_DIR/samples.jsonl
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=1e-4, critic_lr=1e-4, kl_coef=0.05, temperature=1.0)

    @property
    def models(self):
        sft, reward = str(ASSETS["sft"]), str(ASSETS["reward"])
        return {"actor": sft, "ref": sft, "critic": HFModel(sft, new_value_head=True), "reward": reward}

    @property
    def rpcs(self):
        return ppo_rpcs(n_minibatches=self.ppo.n_minibatches)
