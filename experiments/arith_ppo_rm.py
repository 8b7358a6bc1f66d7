"""PPO on the arithmetic task with a reward model trained by realloc (``arith_rm.py``), 2 CPU devices.

The actor, its reference and the critic (a fresh value head) start from the demo's SFT checkpoint
(``data/arith_sft``); the reward model is ``data/arith_rm``: ``arith_rm.py``'s Bradley-Terry model on the shipped
preference pairs, exported by ``realloc export`` as a LlamaForSequenceClassification checkpoint (shipped, 0.8 MB;
the commands below make it again). The reward call scores each sampled answer with it, and nothing else: the
exact-match rule is not in the loss. A side call (``exact_inf``) grades the same answers against the prompt's
``answer`` so metrics.jsonl shows whether the learned reward leads where the true one does: ``reward`` is the
reward model's mean score, ``reward_exact_inf`` the share of exactly right answers; every 10 iterations ``eval``
holds the reward model's mean score of greedy answers to 128 held-out prompts.

    realloc run experiments/arith_rm.py --search-time 5 --save-every 300 --run-dir runs/rm
    realloc export runs/rm --model reward --out runs/rm/reward-hf
    realloc run experiments/arith_ppo_rm.py --set reward_model=runs/rm/reward-hf --search-time 5
"""

import dataclasses

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.api import INFERENCE, HFModel, ModelFunctionCallDef, auto
from realloc.runtime.inputs.evaluation import EvalConfig

SFT = "data/arith_sft"  # shipped; see arith_sft.py
RM = "data/arith_rm"  # shipped; made by the first two commands above
EXACT_MATCH = {"rule": "exact_match", "field": "answer"}  # realloc/algorithms/rewards/text_rules.py


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=4)
@dataclasses.dataclass
class ArithPPOWithRewardModel:
    seed: int = 1
    dataset: str = "data/arith_train.jsonl"  # {"prompt": "1+63=", "answer": "64"} per line
    tokenizer: str = "data/arith_tokenizer"
    iterations: int = 40
    # kl_coef 0.1: the reward model is right on ~80% of held-out pairs, and a policy free to leave the SFT model
    # finds the answers it wrongly scores high (0.02 lets numerically right answers fall 0.70 -> 0.53, 0.1 -> 0.58).
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=2e-4, critic_lr=1e-3, kl_coef=0.1, warmup_proportion=0.1)
    eval: EvalConfig = EvalConfig(dataset="data/arith_eval.jsonl", every=10, greedy=True, batches=4)
    sample_every: int = 10
    reward_model: str = RM  # a sequence-classification checkpoint, relative to this file

    @property
    def models(self):
        hint = ("make it with `realloc run experiments/arith_rm.py --save-every 300 --run-dir runs/rm` and `realloc "
                "export runs/rm --model reward --out experiments/data/arith_rm`")
        return {"actor": SFT, "ref": SFT, "critic": HFModel(SFT, new_value_head=True),
                "reward": HFModel(self.reward_model, build_hint=hint)}

    @property
    def rpcs(self):
        grade = ModelFunctionCallDef(name="exact_inf", model_name="grader", model_type="rule",
                                     interface_type=INFERENCE, interface_impl="verifiable_reward",
                                     input_data=["seq"], output_data=["exact"], interface_args=EXACT_MATCH)
        return [*ppo_rpcs(n_minibatches=self.ppo.n_minibatches), grade]
