"""Multi-turn rollouts with GRPO, RLOO, PPO, DAPO, GSPO or REINFORCE++: interface declarations and the calls (torch-free; the generation is
``multiturn.py``, the environments ``realloc/envs/``).

    rpcs = multiturn_rpcs("grpo", env={"env": "tools", "env_args": {"tools": ["calculator"]}, "max_turns": 3})

The GENERATE call writes ``seq`` (with its ``loss_mask``), ``logp`` and ``rewards`` (the environment's), so the
graph has no reward call: actor_gen -> ref_inf -> actor_train. PPO adds the critic's inference and train step
(``ppo_critic``); its actor and critic train steps run GAE over the policy's tokens (``ppo/policy_tokens.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from realloc.algorithms.critic_free.grpo import PG_INPUTS, GRPOConfig, RLOOConfig
from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig, GSPOConfig, ReinforcePPConfig
from realloc.algorithms.interface import Interface
from realloc.algorithms.ppo.ppo_config import PPOConfig, critic_and_train_calls
from realloc.calls import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef
from realloc.envs.rollout_args import ROLLOUT_CHECK

_MT = "realloc.algorithms.critic_free.multiturn"


def _interfaces(name: str, field: str, cfg: type, train: str | None,
                module: str = "critic_free") -> tuple[Interface, ...]:
    return (Interface(name, GENERATE, f"{_MT}:multiturn_generate", inputs=("prompts",),
                      outputs=("seq", "logp", "rewards"), config=field, config_type=cfg, records=True,
                      check_args=ROLLOUT_CHECK, migrates_tail=False,
                      stepwise=f"{_MT}:TurnRollouts"),
            Interface(name, INFERENCE, f"{_MT}:policy_logprobs", inputs=("seq",), outputs=("logp",), config=field,
                      config_type=cfg)) + (() if train is None else (
            Interface(name, TRAIN_STEP, f"realloc.algorithms.critic_free.{module}:{train}", inputs=PG_INPUTS,
                      config=field, config_type=cfg, min_group_size=2),))


INTERFACES: tuple[Interface, ...] = (*_interfaces("grpo_multiturn", "grpo", GRPOConfig, "grpo_train"),
                                     *_interfaces("rloo_multiturn", "rloo", RLOOConfig, "rloo_train"),
                                     # the train steps of pg_algorithms.py read the loss mask
                                     *_interfaces("dapo_multiturn", "dapo", DAPOConfig, "dapo_train", "pg_steps"),
                                     *_interfaces("gspo_multiturn", "gspo", GSPOConfig, "gspo_train", "pg_steps"),
                                     *_interfaces("reinforce_pp_multiturn", "reinforce_pp", ReinforcePPConfig,
                                                  "reinforce_pp_train", "pg_steps"),
                                     # PPO trains with its own train steps (ppo_actor, ppo_critic)
                                     *_interfaces("ppo_multiturn", "ppo", PPOConfig, None))


ALGORITHMS = ("grpo", "rloo", "ppo", "dapo", "gspo", "reinforce_pp")


def multiturn_rpcs(algorithm: Literal["grpo", "rloo", "ppo", "dapo", "gspo", "reinforce_pp"], env: dict[str, Any],
                   actor: str | None = None, ref: str | None = None, n_samples: int = 8,
                   n_minibatches: int | None = None, critic: str | None = None) -> list[ModelFunctionCallDef]:
    """The calls of GRPO, RLOO, PPO, DAPO, GSPO or REINFORCE++ on multi-turn rollouts; ``env`` is the GENERATE
    call's ``interface_args`` (``realloc/envs/rollout_args.py``). PPO's ``critic`` is a model type (None: from
    the experiment's models). Settings come from the experiment's field of the algorithm's name (``dapo:
    DAPOConfig``, ...)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"multiturn_rpcs: algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got "
                         f"{algorithm!r}")
    impl = f"{algorithm}_multiturn"
    if algorithm == "ppo":
        return _ppo_rpcs(env, actor, ref, critic, n_samples, n_minibatches)
    return [
        ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type=actor, interface_type=GENERATE,
                             interface_impl=impl, input_data=["prompts"], output_data=["seq", "logp", "rewards"],
                             n_samples=n_samples, interface_args=dict(env)),
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=ref or actor, interface_type=INFERENCE,
                             interface_impl=impl, input_data=["seq"], output_data=["ref_logp"]),
        ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP, interface_impl=impl,
                             input_data=["seq", "logp", "ref_logp", "rewards"], n_minibatches=n_minibatches),
    ]


def _ppo_rpcs(env: dict[str, Any], actor: str | None, ref: str | None, critic: str | None, n_samples: int,
              n_minibatches: int | None) -> list[ModelFunctionCallDef]:
    return [
        ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type=actor, interface_type=GENERATE,
                             interface_impl="ppo_multiturn", input_data=["prompts"],
                             output_data=["seq", "logp", "rewards"], n_samples=n_samples, interface_args=dict(env)),
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=ref or actor, interface_type=INFERENCE,
                             interface_impl="ppo_multiturn", input_data=["seq"], output_data=["ref_logp"]),
        *critic_and_train_calls(critic, n_minibatches),
    ]
