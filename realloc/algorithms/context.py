"""What an interface function gets and gives back (``registry.Interface.fn``).

    def fn(ctx: CallContext, inputs: Data) -> CallResult

``inputs`` maps each input slot's role to its key's tensors (this dp rank's rows, first dimension
the sequence); ``CallResult.outputs`` maps each output slot's role to the tensors to store under
the call's output key. ``sums`` are added over dp ranks by the master; ``globals`` are the same on
every dp rank and reported once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from realloc.calls import ModelFunctionCallDef
from realloc.models.collective_wait import blocking
from realloc.models.engine import ParallelModel

Data = dict[str, dict[str, torch.Tensor]]  # key -> tensor name -> [n, ...]


@dataclasses.dataclass
class CallContext:
    call: ModelFunctionCallDef
    model: ParallelModel | None  # None for a rule function
    optimizer: torch.optim.Optimizer | None
    config: Any  # the interface's settings (PPOConfig for PPO; see registry.Interface.config)
    prompt_len: int
    gen_len: int
    seed: int
    iteration: int
    ids: "range | Sequence[int]"  # global indices of this dp rank's rows (a list: a streamed part, token-balanced ranks)
    batch_size: int  # sequences of the whole batch
    n_mbs: int
    total_iterations: int = 0  # the learning-rate schedule's horizon in iterations (0: iteration + 1)
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these (the tokenizer's EOS)
    pad_token_id: int = 0
    vocab_limit: int | None = None  # generation never emits ids >= this (the tokenizer's length; None: no limit)
    greedy: bool = False  # generation: argmax instead of sampling (evaluation)
    purpose: str = "generate"  # names the sampling stream: training and each eval batch draw their own
    recompute: bool = False  # train steps recompute activations (CallPlacement.recompute)
    group_size: int = 1  # responses per prompt: sequences group*n .. group*n + n-1 answer one prompt
    tokenizer: Any = None  # realloc.data.Tokenizer when the experiment has one (decoding, text rules)
    records: Any = None  # row -> the dataset record of that row (Interface.records), else None
    lr_field: str | None = None  # TRAIN_STEP: the settings' field with the base learning rate (Interface.lr)
    optimizer_steps: int = 0  # optimizer steps this call has taken (common.optimizer_step counts them)
    lr_set: float | None = None  # the learning rate common.set_step_lr last put into the optimizer
    lr_managed: bool = True  # False once the train step set the learning rate itself
    partial: Any = None  # a generation call's partial_rollout.PartialRollouts (partial rollouts on), else None

    @property
    def schedule_steps(self) -> int:
        """Optimizer steps the learning-rate schedule spans; a step past them keeps the schedule's last lr."""
        return (self.total_iterations or self.iteration + 1) * self.call.n_minibatches


@dataclasses.dataclass
class CallResult:
    outputs: Data  # by output slot role (the caller stores them under the call's output keys)
    sums: dict[str, float]  # additive over dp ranks (the master sums the dp ranks' reports)
    globals: dict[str, float]  # identical on every dp rank (reported once)

    def check(self, call: str, interface: str, keys: Mapping[str, str], rank: int, early_stage: bool) -> None:
        """The outputs are the declared ones (``keys``: output slot role -> the call's key). Only a pipeline
        stage before the last (``early_stage``), which holds no results, may return none at all: an empty
        result from any other rank would leave its rows missing in the store, an error far from its cause."""
        if not isinstance(self, CallResult) or not isinstance(self.outputs, dict):
            raise ValueError(f"call {call!r}: interface {interface!r} must return a CallResult")
        roles = list(keys)
        missing = [r for r in roles if r not in self.outputs]
        extra = [r for r in self.outputs if r not in roles]
        if not self.outputs and missing and not early_stage:
            raise ValueError(f"call {call!r}: interface {interface!r} returned no outputs on rank {rank}, so key "
                             f"{keys[missing[0]]!r} (slot {missing[0]!r}) has no rows from it; every data-parallel "
                             f"rank must return all of {roles} for its rows (only a pipeline stage before the last "
                             f"may return none)")
        if self.outputs and (missing or extra):
            raise ValueError(f"call {call!r}: interface {interface!r} declared outputs {roles} but produced "
                             f"{sorted(self.outputs)} on rank {rank}; fix the function or its Interface(outputs=...)")



def dp_all_reduce(model: ParallelModel | None, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the model's data-parallel ranks (a CPU tensor in, a CPU tensor out)."""
    if model is None or model.groups.dp == 1:
        return t
    t = t.to(model.device)
    blocking(dist.all_reduce, t, group=model.groups.dp_group)
    return t.cpu()


def reward_sums(call: str, interface: str, result: CallResult, roles: list[str], n_rows: int) -> dict[str, float]:
    """The reward contract: a call that writes a ``rewards`` key returns one finite score per sequence
    (``{"score": [n]}``); from it the framework makes the stats behind the ``reward`` metrics (``score_sum`` and
    ``n_seqs_scored``, summed over dp ranks), so a reward function reports nothing itself. ``roles``: the call's
    output slots of kind ``rewards`` (the first one is the call's reward). {} on a rank that holds no results."""
    if not roles or roles[0] not in result.outputs:
        return {}
    got = result.outputs[roles[0]]
    score = got.get("score") if isinstance(got, dict) else None
    if not isinstance(score, torch.Tensor) or score.dim() != 1 or score.shape[0] != n_rows:
        what = (f"shape {tuple(score.shape)}" if isinstance(score, torch.Tensor)
                else f"tensors {sorted(got)}" if isinstance(got, dict) else f"a {type(got).__name__}")
        raise ValueError(f"call {call!r}: interface {interface!r} must return one score per sequence as "
                         f"{{{roles[0]!r}: {{'score': tensor of shape ({n_rows},)}}}}, got {what}")
    if not torch.isfinite(score).all():
        bad = int((~torch.isfinite(score)).nonzero()[0])
        raise ValueError(f"call {call!r}: interface {interface!r} returned a non-finite score ({float(score[bad])}) "
                         f"for sequence {bad} of this rank's {n_rows}; a reward must be a finite number")
    return {"score_sum": float(score.double().sum()), "n_seqs_scored": float(n_rows)}

