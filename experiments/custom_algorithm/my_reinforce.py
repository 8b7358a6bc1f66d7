"""REINFORCE++ (Hu 2025, arXiv:2501.03262) as a user's own algorithm, on realloc's train-step API.

Not a shipped algorithm: everything it needs is this file. The train step is a loss function plus the stats it
declares; realloc does the mini-batches, the dp/pp reductions, clipping and the learning-rate schedule.

- reward per token (§3.1): the sequence's score at its last token, minus ``kl_coef`` x the k1 KL estimate
  ``log pi_old - log pi_ref`` at every token;
- return: the sum of the rewards from token t on (gamma = 1);
- advantage: the return normalized over the whole batch, every dp rank's tokens together (§3.2);
- loss: PPO's clipped surrogate per token, averaged over the mini-batch's tokens.
"""

from __future__ import annotations

import dataclasses
import torch
from realloc.algorithms.common import actor_generate, actor_logprobs
from realloc.algorithms.registry import Interface
from realloc.algorithms.train_config import TrainConfig
from realloc.algorithms.train_step import MiniBatch, Rollout, TrainStep
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP

@dataclasses.dataclass(frozen=True)
class MyReinforceConfig(TrainConfig):  # lr, lr_schedule, n_minibatches, max_grad_norm, temperature, ...
    kl_coef: float = 0.01
    clip_eps: float = 0.2

def advantages(ro: Rollout) -> dict[str, torch.Tensor]:
    """Once per call, on this dp rank's whole batch: per-token returns, whitened over the whole batch."""
    mask = ro.mask                                                  # [n, T] response tokens
    kl = (ro["logp"]["logp"] - ro["ref_logp"]["logp"]) * mask
    reward = -ro.config.kl_coef * kl                                # KL penalty at every token ...
    last = (mask.sum(dim=1) - 1).clamp(min=0)
    reward[torch.arange(len(last)), last] += ro["rewards"]["score"] * mask.any(dim=1)  # ... score at the last
    returns = reward.flip(1).cumsum(dim=1).flip(1) * mask          # gamma = 1
    return {"adv": ro.whiten(returns), "kl": kl.sum(dim=1)}        # whiten: mean/std over every dp rank's tokens

def loss(mb: MiniBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per micro-batch: the clipped surrogate per response token, and the declared stats."""
    eps, adv = mb.config.clip_eps, mb.extra["adv"]
    ratio = torch.exp(mb.logprobs() - mb["logp"]["logp"])          # logprobs(): the model being trained
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)
    return torch.maximum(unclipped, clipped), {"clip_frac": (clipped > unclipped).float(), "kl": mb.extra["kl"]}

TRAIN = TrainStep(loss, stats=("clip_frac", "kl"), prepare=advantages, loss_norm="token")
INTERFACES = [  # generation and log-probs: realloc's own functions, with this algorithm's settings
    Interface("my_reinforce", GENERATE, actor_generate, inputs=("prompts",), outputs=("seq", "logp"),
              config="my_reinforce", config_type=MyReinforceConfig),
    Interface("my_reinforce", INFERENCE, actor_logprobs, inputs=("seq",), outputs=("logp",),
              config="my_reinforce", config_type=MyReinforceConfig),
    Interface("my_reinforce", TRAIN_STEP, TRAIN, inputs=("seq", "logp", "ref_logp:logp", "rewards"),
              config="my_reinforce", config_type=MyReinforceConfig),
]


from realloc.api import ModelFunctionCallDef  # noqa: E402 - the example in docs/algorithms.md ends above


def rpcs(actor: str, reward: str, reward_impl: str, reward_args: dict) -> list[ModelFunctionCallDef]:
    """Generation, reward, reference log-probs and the train step."""
    return [
        ModelFunctionCallDef(name="actor_gen", model_name="actor", model_type=actor, interface_type=GENERATE,
                             interface_impl="my_reinforce", input_data=["prompts"], output_data=["seq", "logp"]),
        ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type=reward, interface_type=INFERENCE,
                             interface_impl=reward_impl, input_data=["seq"], output_data=["rewards"],
                             interface_args=reward_args),
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=actor, interface_type=INFERENCE,
                             interface_impl="my_reinforce", input_data=["seq"], output_data=["ref_logp"]),
        ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                             interface_impl="my_reinforce", input_data=["seq", "logp", "ref_logp", "rewards"]),
    ]
