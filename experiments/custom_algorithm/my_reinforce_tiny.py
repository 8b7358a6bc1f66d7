"""A user's own algorithm (REINFORCE++, ``my_reinforce.py`` beside this file) on the tiny token-set task of
``ppo_tiny.py``: 2 CPU devices, one response per prompt, the rule rewards tokens 16..31 of the 64."""

import dataclasses

from my_reinforce import INTERFACES, MyReinforceConfig, rpcs

from realloc.api import auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class MyReinforceTiny:
    seed: int = 1
    dataset: str = "../data/ppo_tiny_prompts.jsonl"
    iterations: int = 30
    my_reinforce: MyReinforceConfig = MyReinforceConfig(n_minibatches=2, lr=2e-3, kl_coef=0.01)

    @property
    def interfaces(self):
        return INTERFACES

    @property
    def rpcs(self):
        return rpcs(actor="tiny", reward="rule", reward_impl="rule_reward",
                    reward_args={"rule": "token_set", "tokens": list(range(16, 32))})
