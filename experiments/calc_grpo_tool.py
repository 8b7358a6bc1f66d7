"""GRPO with a calculator tool on three-digit times two-digit multiplication (2 CPU devices): the tool demo.

Each rollout is a conversation (``grpo_multiturn``, docs/multi-turn.md): the policy may call the calculator as
``<c>123*45</c>``; the built-in ToolEnv runs it in the sandbox and appends ``<r>5535</r>``; the next turn is the
final answer, scored 1 when its first number is the record's ``answer``. Only the policy's tokens are trained.
The actor starts from the SFT stage (calc_sft.py) when ``init`` names its export, as ``python -m
realloc.demo.calc_demo`` does; without one, from random weights (model type "tiny").

    realloc run experiments/calc_grpo_tool.py --search-time 5 --set init=runs/calc_demo/sft_tool
"""

import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import HFModel, auto
from realloc.runtime.inputs.evaluation import EvalConfig

ENV = {"env": "tools",
       "env_args": {"tools": {"c": "calculator"}, "result_format": "<r>{}</r>", "field": "answer",
                    "limits": {"wall_s": 30.0}},
       "max_turns": 2, "turn_tokens": 16}


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=16, prompt_len=8, gen_len=32)
@dataclasses.dataclass
class CalcGRPOTool:
    seed: int = 1
    dataset: str = "data/calc_train.jsonl"  # {"prompt": "163*16=", "answer": "2608"} per line
    tokenizer: str = "data/calc_tokenizer"
    iterations: int = 100
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=5e-4, kl_coef=0.01, temperature=0.8)
    init: str = ""  # the SFT stage's export ("": random weights)
    # held-out exact match with the tool, greedy, the environment in the loop: 12 batches of 16 = 192 of the 200
    eval: EvalConfig = EvalConfig(dataset="data/calc_eval.jsonl", every=25, batches=12)

    @property
    def models(self):
        return {"actor": HFModel(self.init), "ref": HFModel(self.init)} if self.init else {}

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor=None if self.init else "tiny", n_samples=8)
