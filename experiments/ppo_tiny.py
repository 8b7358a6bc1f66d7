"""A tiny PPO run for the local CPU cluster: 2 gloo devices on localhost.

Task: the actor (a 4-layer LLaMA with a 64-token vocabulary) is rewarded by a rule for
every generated token that falls in a target set of 16 token ids (a quarter of the
vocabulary). A freshly initialized policy samples nearly uniformly, so its mean reward
starts at chance, about 0.25; PPO lifts it above 0.8 within a few dozen iterations, which
shows that generation, reward, reference and critic inference, training and the parameter
reallocation between them are all correct together. No reward model has to be trained.

Prompts are 256 random 8-token sequences shipped in ``data/ppo_tiny_prompts.jsonl``
(made with ``realloc.data.prompts.write_random_prompts(path, 256, 8, 64, seed=0)``); the eval set
``data/ppo_tiny_eval.jsonl`` holds 32 more (``write_random_prompts(path, 32, 8, 64, seed=1)``).
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto
from realloc.runtime.inputs.evaluation import EvalConfig

PPO_INPUTS = ["seq", "logp", "ref_logp", "rewards", "values"]
TARGET_TOKENS = list(range(16, 32))


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class TinyPPO:
    seed: int = 1
    dataset: str = "data/ppo_tiny_prompts.jsonl"  # relative to this file
    iterations: int = 30
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=2e-3, critic_lr=2e-3, kl_coef=0.01)
    # 32 held-out prompts; evaluation is off unless asked for, e.g. --set eval.every=10
    eval: EvalConfig = EvalConfig(dataset="data/ppo_tiny_eval.jsonl", every=0)

    @property
    def rpcs(self):
        return [
            ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type="tiny",
                                 interface_type=GENERATE, interface_impl="ppo_actor",
                                 input_data=["prompts"], output_data=["seq", "logp"]),
            ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule",
                                 interface_type=INFERENCE, interface_impl="rule_reward",
                                 input_data=["seq"], output_data=["rewards"],
                                 interface_args={"rule": "token_set", "tokens": TARGET_TOKENS}),
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
