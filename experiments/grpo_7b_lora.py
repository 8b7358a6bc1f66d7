"""LoRA GRPO, 7B actor + 7B reward model on 2 nodes of 8 A100s: ``grpo_7b_7b.py`` with a frozen actor base.

Rank-16 adapters on every projection (40M trained parameters of 8.0B) are all the train step updates, so its
gradients and AdamW state are 0.5% of full fine-tuning's; the reference is the actor's own base with the
adapters off (``reference_from_base``), so there is no reference model to place or reallocate.
``realloc search experiments/grpo_7b_lora.py --dry-run`` prints the plan.
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import LoRAConfig, auto, reference_from_base


@auto(nodelist="trainer[01-02]", n_devices_per_node=8, device="a100-80g", batch_size=64,
      prompt_len=1024, gen_len=1024)
@dataclasses.dataclass
class GRPO7BLoRA:
    grpo: GRPOConfig = GRPOConfig(n_minibatches=4, lr=1e-5)
    lora: LoRAConfig = LoRAConfig(rank=16, alpha=32)
    dataset: str | None = None

    @property
    def rpcs(self):
        return reference_from_base(critic_free_rpcs("grpo", actor="llama3-8b", reward="llama3-8b-critic",
                                                    n_samples=8))
