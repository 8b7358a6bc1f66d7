"""A tiny PPO run for the local CPU cluster: 2 gloo devices on localhost.

The actor learns a synthetic task scored by a rule-based reward over token ids,
so no reward model has to be trained first.
"""

import dataclasses

from realloc.algorithms.ppo_config import PPOConfig
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto

PPO_INPUTS = ["seq", "logp", "ref_logp", "rewards", "values"]


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyPPO:
    seed: int = 1
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=1e-3, critic_lr=1e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return [
            ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type="tiny",
                                 interface_type=GENERATE, interface_impl="ppo_actor",
                                 input_data=["prompts"], output_data=["seq", "logp"]),
            ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule",
                                 interface_type=INFERENCE, interface_impl="rule_reward",
                                 input_data=["seq"], output_data=["rewards"]),
            ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type="tiny",
                                 interface_type=INFERENCE, interface_impl="ppo_actor",
                                 input_data=["seq"], output_data=["ref_logp"]),
            ModelFunctionCallDef(name="critic_inf", model_name="critic", model_type="tiny-critic",
                                 interface_type=INFERENCE, interface_impl="ppo_critic",
                                 input_data=["seq"], output_data=["values"]),
            ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                 interface_impl="ppo_actor", input_data=PPO_INPUTS,
                                 n_minibatches=self.ppo.n_minibatches),
            ModelFunctionCallDef(name="critic_train", model_name="critic", interface_type=TRAIN_STEP,
                                 interface_impl="ppo_critic", input_data=PPO_INPUTS,
                                 n_minibatches=self.ppo.n_minibatches),
        ]
