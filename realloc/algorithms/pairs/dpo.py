"""DPO and SFT: training on fixed data, no generation. Settings, graphs, interface declarations (torch-free);
implementations in ``supervised.py``.

- DPO (Rafailov et al. 2023): the dataset gives (prompt, chosen, rejected) pairs (``realloc.data``); a
  reference INFERENCE call scores both responses (summed log-probs, kind ``pair_logp``); the actor's
  train step minimizes ``-log sigmoid(beta * margin)`` and reports the reward margin and preference accuracy.
- SFT: the dataset gives (prompt, response) pairs in the ``seq`` layout; the train step minimizes the
  negative log-likelihood of the response tokens only (the prompt is context). It is also the warm-start
  stage of the RL algorithms: its checkpoint exports as an HF directory that `models` can name.
"""

from __future__ import annotations

import dataclasses

from realloc.algorithms.interface import Interface
from realloc.algorithms.train_config import TrainConfig
from realloc.calls import INFERENCE, TRAIN_STEP, ModelFunctionCallDef


@dataclasses.dataclass(frozen=True)
class DPOConfig(TrainConfig):
    lr: float = 1e-6
    beta: float = 0.1
    label_smoothing: float = 0.0  # conservative DPO: the chance that a label is flipped

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta > 0 or not 0 <= self.label_smoothing < 0.5:
            raise ValueError("DPOConfig: beta must be > 0 and label_smoothing in [0, 0.5)")


@dataclasses.dataclass(frozen=True)
class SFTConfig(TrainConfig):
    lr: float = 1e-5


_IMPL = "realloc.algorithms.pairs.supervised"
INTERFACES: tuple[Interface, ...] = (
    Interface("dpo_ref", INFERENCE, f"{_IMPL}:pair_logprobs", inputs=("pairs",), outputs=("ref_logp:pair_logp",),
              config="dpo", config_type=DPOConfig, rows_per_seq=2),
    Interface("dpo_actor", TRAIN_STEP, f"{_IMPL}:dpo_train", inputs=("pairs", "ref_logp:pair_logp"),
              config="dpo", config_type=DPOConfig, rows_per_seq=2),
    Interface("sft", TRAIN_STEP, f"{_IMPL}:sft_train", inputs=("seq",), config="sft", config_type=SFTConfig),
)


def dpo_rpcs(actor: str | None = None, ref: str | None = None,
             n_minibatches: int | None = None) -> list[ModelFunctionCallDef]:
    """Reference scores of each pair, then the actor's DPO step. The experiment's ``dataset_keys`` must
    include ``pairs`` (``@auto(..., dataset_keys=["pairs"])``)."""
    return [
        ModelFunctionCallDef(name="ref_inf", model_name="ref", model_type=ref or actor, interface_type=INFERENCE,
                             interface_impl="dpo_ref", input_data=["pairs"], output_data=["ref_pair_logp"]),
        ModelFunctionCallDef(name="actor_train", model_name="actor", model_type=actor, interface_type=TRAIN_STEP,
                             interface_impl="dpo_actor", input_data=["pairs", "ref_pair_logp"],
                             n_minibatches=n_minibatches),
    ]


def sft_rpcs(actor: str | None = None, n_minibatches: int | None = None) -> list[ModelFunctionCallDef]:
    """One train step over (prompt, response) pairs; ``@auto(..., dataset_keys=["sft"])``."""
    return [ModelFunctionCallDef(name="actor_train", model_name="actor", model_type=actor, interface_type=TRAIN_STEP,
                                 interface_impl="sft", input_data=["sft"], n_minibatches=n_minibatches)]
