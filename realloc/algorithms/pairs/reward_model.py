"""Reward-model training on preference pairs (Bradley-Terry): settings, graph and interface declarations
(torch-free); the implementation is in ``rm_train.py``.

The dataset gives ``{"prompt", "chosen", "rejected"}`` records (``realloc.data.PreferenceDataset``, the
``pairs`` key, as DPO reads them). The model has a scalar head; a response's reward is the head's output at
its last token (prompt + response + EOS), exactly what the ``reward`` INFERENCE interface of a PPO graph
reads, so the trained model, exported with ``realloc export``, is that graph's reward model as it is.

The loss is the Bradley-Terry negative log-likelihood of the human choice (Ouyang et al. 2022, InstructGPT
eq. 1; Touvron et al. 2023, Llama 2 eq. 1 for the margin)::

    loss = -log sigmoid(r(x, y_c) - r(x, y_r) - m)

with ``m`` the constant ``margin`` plus, with ``margin_field``, a per-pair margin read from the record
(Llama 2's preference-strength margin). ``center_coef`` adds ``center_coef * (r_c + r_r)^2`` (Eisenstein et
al. 2023, "Helping or herding": keeps rewards centred at 0, since the Bradley-Terry loss only fixes their
differences). metrics.jsonl reports ``rm_loss``, ``rm_accuracy`` (pairs with ``r_c > r_r``, before the
step), ``rm_margin`` (mean ``r_c - r_r``), ``rm_chosen`` and ``rm_rejected`` (mean rewards); with an
``eval: EvalConfig(dataset=<held-out pairs>, every=N)`` the same pair metrics on the held-out set go under
``"eval"`` (the ``rm`` INFERENCE interface, run in the train step's layout).
"""

from __future__ import annotations

import dataclasses

from realloc.algorithms.interface import Interface
from realloc.algorithms.train_config import TrainConfig
from realloc.calls import INFERENCE, TRAIN_STEP, ModelFunctionCallDef


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(TrainConfig):
    lr: float = 1e-5
    margin: float = 0.0  # subtracted from every pair's reward difference inside the sigmoid
    margin_field: str | None = None  # a numeric record field with a per-pair margin, added to `margin`
    center_coef: float = 0.0  # weight of the (r_c + r_r)^2 centring penalty

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool):
            raise ValueError(f"RewardModelConfig.margin must be a number, got {self.margin!r}")
        if self.margin_field is not None and (not isinstance(self.margin_field, str) or not self.margin_field):
            raise ValueError(f"RewardModelConfig.margin_field must be a record field name or None, got "
                             f"{self.margin_field!r}")
        if not isinstance(self.center_coef, (int, float)) or not self.center_coef >= 0:
            raise ValueError(f"RewardModelConfig.center_coef must be >= 0, got {self.center_coef!r}")


STATS = ("rm_loss", "rm_accuracy", "rm_margin", "rm_chosen", "rm_rejected")  # per train step, means over pairs
# The scoring call reports sums (added over dp ranks and eval batches) under other names, so that they never mix
# with the train step's means in an iteration's metrics.
PAIR_SUMS = {k: f"pairs_{k[3:]}_sum" for k in STATS}


def pair_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The pair metrics (``rm_loss``, ``rm_accuracy``, ...) as means, from ``rm_pair_scores``' summed stats."""
    n = max(sums.get("n_pairs", 0.0), 1.0)
    return {**{k: sums.get(s, 0.0) / n for k, s in PAIR_SUMS.items()}, "n": int(sums.get("n_pairs", 0.0))}


_IMPL = "realloc.algorithms.pairs.rm_train"
INTERFACES: tuple[Interface, ...] = (
    Interface("rm", TRAIN_STEP, f"{_IMPL}:rm_train", inputs=("pairs",), head="value", config="rm",
              config_type=RewardModelConfig, records=True, rows_per_seq=2),
    # Scores of both responses of each pair, and the pair metrics (the held-out evaluation runs this).
    Interface("rm", INFERENCE, f"{_IMPL}:rm_pair_scores", inputs=("pairs",), outputs=("pair_rewards:pair_scores",),
              head="value", config="rm", config_type=RewardModelConfig, records=True, rows_per_seq=2),
)


def rm_rpcs(model_type: str | None = None, n_minibatches: int | None = None) -> list[ModelFunctionCallDef]:
    """One train step of the ``reward`` model over preference pairs; ``@auto(..., dataset_keys=["pairs"])``.
    Without ``model_type`` the experiment's ``models`` maps ``reward`` to a checkpoint (e.g.
    ``HFModel(sft, new_value_head=True)``)."""
    return [ModelFunctionCallDef(name="rm_train", model_name="reward", model_type=model_type,
                                 interface_type=TRAIN_STEP, interface_impl="rm", input_data=["pairs"],
                                 n_minibatches=n_minibatches)]
