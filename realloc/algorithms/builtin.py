"""The interfaces realloc ships, declared for the registry (``registry.py``). Torch-free: implementations
are named as ``"module:function"`` and imported by the workers that run them.

Data kinds (see ``common.py`` for the tensors of each):
``prompts`` (from the dataset), ``seq`` (prompt + response tokens; from generation, or from an SFT
dataset), ``logp`` (per response token), ``values`` (per response token), ``rewards`` (one score per
sequence), ``pairs`` (DPO's chosen and rejected responses, from the dataset), ``pair_logp`` (their summed
log-probs), ``pair_scores`` (a reward model's score of each pair's chosen and rejected response).
"""

from __future__ import annotations

from realloc.algorithms.critic_free import grpo, multiturn_graph, pg_algorithms
from realloc.algorithms.interface import Interface
from realloc.algorithms.pairs import dpo, reward_model
from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.calls import GENERATE, INFERENCE, TRAIN_STEP

_PPO = "realloc.algorithms.ppo.ppo_interfaces"
_COMMON = "realloc.algorithms.common"
_REWARDS = "realloc.algorithms.rewards.reward_fns"
_RULES = "realloc.algorithms.rewards.rule_reward"
_REWARD_ARGS = "realloc.algorithms.rewards.reward_args"
PPO_TRAIN_INPUTS = ("seq", "logp", "ref_logp:logp", "rewards", "values")

BUILTIN: tuple[Interface, ...] = (
    # PPO (realhf.txt Figure 1): generation, reference/actor log-probs, critic values, and both train steps.
    Interface("ppo_actor", GENERATE, f"{_COMMON}:actor_generate", inputs=("prompts",), outputs=("seq", "logp"),
              config="ppo", config_type=PPOConfig),
    Interface("ppo_actor", INFERENCE, f"{_COMMON}:actor_logprobs", inputs=("seq",), outputs=("logp",),
              config="ppo", config_type=PPOConfig),
    Interface("ppo_actor", TRAIN_STEP, f"{_PPO}:actor_train", inputs=PPO_TRAIN_INPUTS,
              config="ppo", config_type=PPOConfig),
    Interface("ppo_critic", INFERENCE, f"{_COMMON}:critic_values", inputs=("seq",), outputs=("values",), head="value",
              config="ppo", config_type=PPOConfig),
    Interface("ppo_critic", TRAIN_STEP, f"{_PPO}:critic_train", inputs=PPO_TRAIN_INPUTS, head="value",
              config="ppo", config_type=PPOConfig, lr="critic_lr"),
    # Rewards: a neural reward model (a scalar head at the last token), or a rule on token ids.
    Interface("reward", INFERENCE, f"{_COMMON}:model_reward", inputs=("seq",), outputs=("rewards",), head="value"),
    Interface("rule_reward", INFERENCE, f"{_RULES}:rule_scores", inputs=("seq",), outputs=("rewards",), head="none"),
    # A rule on the decoded text and the prompt's dataset record (e.g. exact match with its answer).
    Interface("verifiable_reward", INFERENCE, f"{_RULES}:verifiable_scores", inputs=("seq",), outputs=("rewards",),
              head="none", records=True),
    # Rewards users bring (reward_fns.py): a batched function of the texts and records, a remote HTTP service,
    # and a weighted mix of two reward keys (a rule and a reward model, say).
    Interface("batch_reward", INFERENCE, f"{_REWARDS}:batch_scores", inputs=("seq",), outputs=("rewards",),
              head="none", records=True, check_args=f"{_REWARD_ARGS}:check_batch"),
    Interface("remote_reward", INFERENCE, f"{_REWARDS}:remote_scores", inputs=("seq",), outputs=("rewards",),
              head="none", records=True, check_args=f"{_REWARD_ARGS}:check_remote"),
    Interface("mix_rewards", INFERENCE, f"{_REWARDS}:mix_scores", inputs=("rewards", "other:rewards"),
              outputs=("rewards",), head="none", check_args=f"{_REWARD_ARGS}:check_mix"),
    *grpo.INTERFACES,
    *multiturn_graph.INTERFACES,  # multi-turn rollouts with an environment (multiturn.py)
    *pg_algorithms.INTERFACES,
    *dpo.INTERFACES,
    *reward_model.INTERFACES,
)
