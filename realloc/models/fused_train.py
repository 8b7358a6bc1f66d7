"""Two models' train steps as one fused pipeline schedule (rlhfuse.txt §5, intra-stage fusion).

Both models are resident on the same devices with the same pp; the second model's stages run in the
reverse order of the first's (its layout's stage groups are reversed: ``graph/fused.py``). Each model begins
its train step (``ParallelModel.begin_train_step``: checks, packing, gradient buffers), then this device
runs both models' forward and backward passes in the order the schedule search chose for its stage group
(``fused_pipeline.run_fused``; messages tagged by model), and only after both finish does each model reduce
its gradients and step its optimizer (``finish_train_step``). Each model's passes keep its micro-batch
order, so its gradients, and so its parameters and optimizer state, are those of its own ``train_step``.
Recomputation, sequence parallelism, packing and the distributed optimizer are the engine's own, inside
the passes and the finish.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from realloc.models.batch import Batch
from realloc.models.engine import LossFn, ParallelModel, TrainPasses
from realloc.models.fused_pipeline import FusedPart, check_order, run_fused

# The second model's pipeline messages between the same two devices carry these tags plus FORWARD_TAG /
# BACKWARD_TAG (pipeline.py), so they never match the first model's.
SECOND_TAG_OFFSET = 100

Pass = tuple[int, int, int]  # (model 0/1, backward 0/1, micro-batch)


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """What one model's ``ParallelModel.train_step`` would have been called with."""

    micro_batches: Sequence[Batch]
    loss_fn: LossFn
    optimizer: Any
    max_grad_norm: float | None = None
    loss_weights: Sequence[float] | None = None
    recompute: bool = False

    @classmethod
    def of_call(cls, args: Sequence[Any], kwargs: Mapping[str, Any]) -> "TrainArgs":
        """From the arguments of a ``train_step(micro_batches, loss_fn, optimizer, **kw)`` call."""
        return cls(*args, **kwargs)


def check_fusable(models: Sequence[ParallelModel]) -> None:
    a, b = models
    if a.groups.pp != b.groups.pp:
        raise ValueError(f"fused_train_step: the two models need the same pp, got {a.groups.pp} and {b.groups.pp}")
    if a.groups.pp > 1 and a.groups.pp_rank != b.groups.pp - 1 - b.groups.pp_rank:
        raise ValueError(f"fused_train_step: the second model's stages must run in reverse order (this device holds "
                         f"stage {a.groups.pp_rank} of the first and {b.groups.pp_rank} of the second)")


def fused_train_step(models: Sequence[ParallelModel], args: Sequence[TrainArgs], orders: Sequence[Sequence[Pass]],
                     record: list[tuple[int, int, int, float, float]] | None = None
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """One optimizer step of each model, their passes in ``orders`` (every stage group's list from the schedule
    search, ``FusedSchedule.order``; this device runs the list of the first model's ``pp_rank``, and the
    others say in which order its messages cross). Returns each model's ``train_step`` stats.
    ``record``: gets each pass's (model, backward, micro-batch, start, end) (``fused_pipeline.run_fused``)."""
    if len(models) != 2 or len(args) != 2:
        raise ValueError(f"fused_train_step: fuses two models, got {len(models)}")
    check_fusable(models)
    runs: list[TrainPasses] = []
    try:
        for m, a in zip(models, args):
            runs.append(m.begin_train_step(a.micro_batches, a.loss_fn, a.optimizer, max_grad_norm=a.max_grad_norm,
                                           loss_weights=a.loss_weights, recompute=a.recompute))
        parts = [FusedPart(m.stage_link(k * SECOND_TAG_OFFSET), r.n_mbs, r.forward_step, r.activation_shape)
                 for k, (m, r) in enumerate(zip(models, runs))]
        with torch.enable_grad():
            if models[0].groups.pp == 1:
                _run_unpipelined(orders[0], parts)
            else:
                run_fused(orders, parts, record)
    except BaseException:
        for m in models[:len(runs)]:
            m.abandon_train_step()
        raise
    try:
        first = models[0].finish_train_step(runs[0])
    except BaseException:
        models[1].abandon_train_step()
        raise
    return first, models[1].finish_train_step(runs[1])


def _run_unpipelined(order: Sequence[Pass], parts: Sequence[FusedPart]) -> None:
    """pp = 1: nothing crosses devices; each forward's loss is backpropagated at its backward's place."""
    check_order(order, parts)
    losses: list[list[torch.Tensor]] = [[], []]
    for m, backward, mb in order:
        if backward:
            torch.autograd.backward(losses[m].pop(0))
        else:
            losses[m].append(parts[m].forward_step(mb, None))
