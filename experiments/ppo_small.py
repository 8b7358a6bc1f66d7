"""PPO with the ``small`` model on the local CPU cluster: 2 gloo devices on localhost.

The same task as ``ppo_tiny.py`` (a rule rewards generated tokens from a target set), with
a model 16x larger (hidden 256, 4 layers, 256-token vocabulary) and 24 generated tokens,
so that calls are dominated by compute (hundreds of milliseconds each) rather than by
per-call overheads, and where calls run matters: training the actor and the critic on
separate devices, data parallelism, or tensor parallelism over gloo give iteration times
that differ by several times. ``benchmarks/estimator_accuracy.py`` runs it under many
plans and compares the estimator with what runs.

Prompts are the tiny experiment's 8-token prompts (token ids below 64, valid here too).
"""

import dataclasses

from realloc.algorithms.ppo_config import PPOConfig
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto

PPO_INPUTS = ["seq", "logp", "ref_logp", "rewards", "values"]
TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class SmallPPO:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"  # relative to this file
    iterations: int = 10
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=1e-3, critic_lr=1e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return [
            ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type="small",
                                 interface_type=GENERATE, interface_impl="ppo_actor",
                                 input_data=["prompts"], output_data=["seq", "logp"]),
            ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule",
                                 interface_type=INFERENCE, interface_impl="rule_reward",
                                 input_data=["seq"], output_data=["rewards"],
                                 interface_args={"rule": "token_set", "tokens": TARGET_TOKENS}),
            ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type="small",
                                 interface_type=INFERENCE, interface_impl="ppo_actor",
                                 input_data=["seq"], output_data=["ref_logp"]),
            ModelFunctionCallDef(name="critic_inf", model_name="critic", model_type="small-critic",
                                 interface_type=INFERENCE, interface_impl="ppo_critic",
                                 input_data=["seq"], output_data=["values"]),
            ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                 interface_impl="ppo_actor", input_data=PPO_INPUTS,
                                 n_minibatches=self.ppo.n_minibatches),
            ModelFunctionCallDef(name="critic_train", model_name="critic", interface_type=TRAIN_STEP,
                                 interface_impl="ppo_critic", input_data=PPO_INPUTS,
                                 n_minibatches=self.ppo.n_minibatches),
        ]
