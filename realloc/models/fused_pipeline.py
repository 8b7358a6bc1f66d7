"""One stage's share of a fused pipeline schedule (rlhfuse.txt §5): two models' train passes in one order.

Two models train on the same devices, each on its own pipeline (the second in reverse stage order; see
csrc/fused_schedule.h); ``order`` lists this device's passes as ``(model, backward, micro-batch)`` in the order
the schedule search chose (``realloc._C.FusedProblem.search``). Each pass blocks on its one input (the
previous stage's activation, the next stage's gradient) and posts its output without waiting, which is the
schedule's own rule, so an order the search (or ``FusedProblem.evaluate``) accepts cannot deadlock. Each
model has its own ``StageLink`` on its own stage order, with its own tags (``StageLink(tag_offset=...)``),
so the two models' messages between the same two devices never match each other.

Each model's forwards and backwards run in micro-batch order, so its gradients accumulate in the order
1F1B accumulates them and its optimizer step sees the same gradients as unfused.

Only gloo: on NCCL a send that waits for its receiver can block a later receive (pipeline.py); the fused
order does not pair them as run_1f1b's steady phase does.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist

from realloc.models.pipeline import ForwardStep, ShapeFn, StageLink


@dataclasses.dataclass(frozen=True)
class FusedPart:
    """One model's side of the fused schedule on this device."""

    link: StageLink
    n_mbs: int
    forward_step: ForwardStep
    activation_shape: ShapeFn


def check_order(order: Sequence[tuple[int, int, int]], parts: Sequence[FusedPart]) -> None:
    """Raise ValueError unless ``order`` runs every pass of both parts once, in micro-batch order, each backward
    after its forward."""
    nxt = {(m, bw): 0 for m in range(len(parts)) for bw in (0, 1)}
    for m, bw, mb in order:
        if (m, bw) not in nxt or mb != nxt[(m, bw)] or mb >= parts[m].n_mbs or (bw and nxt[(m, 0)] <= mb):
            raise ValueError(f"fused order: pass {(m, bw, mb)} is out of place (each model's forwards and backwards "
                             f"run in micro-batch order, each backward after its forward)")
        nxt[(m, bw)] += 1
    missing = [(m, bw) for (m, bw), n in nxt.items() if n != parts[m].n_mbs]
    if missing:
        raise ValueError(f"fused order: model {missing[0][0]} is missing passes; it has "
                         f"{parts[missing[0][0]].n_mbs} micro-batches")


def run_fused(order: Sequence[tuple[int, int, int]], parts: Sequence[FusedPart],
              record: list[tuple[int, int, int, float, float]] | None = None) -> None:
    """Forward and backward of every micro-batch of both models in ``order``; gradients accumulate in each
    model's parameters' ``.grad``. ``record``: gets each pass's (model, backward, micro-batch, start, end) in
    wall-clock seconds, from its input's arrival to its output's posting (the timeline draws them)."""
    if len(parts) != 2:
        raise ValueError(f"run_fused: fuses two models, got {len(parts)}")
    for p in parts:
        if dist.get_backend(p.link.groups.pp_group) == "nccl":
            raise ValueError("run_fused: runs on gloo only (on NCCL an unpaired send can block a later receive)")
    check_order(order, parts)
    in_flight: list[list[tuple[torch.Tensor | None, torch.Tensor]]] = [[], []]
    for m, backward, mb in order:
        part = parts[m]
        link, g = part.link, part.link.groups
        if not backward:
            x = None if g.is_first_stage else link.recv_forward(part.activation_shape(mb))
            if x is not None:
                x.requires_grad_(True)
            t0 = time.time()
            out = part.forward_step(mb, x)
            in_flight[m].append((x, out))
            if not g.is_last_stage:
                link.send_forward(out)
        else:
            x, out = in_flight[m].pop(0)
            grad = None if g.is_last_stage else link.recv_backward(part.activation_shape(mb))
            t0 = time.time()
            torch.autograd.backward(out, grad_tensors=grad)
            if not g.is_first_stage:
                link.send_backward(x.grad)
        if record is not None:
            record.append((m, backward, mb, t0, time.time()))
    for p in parts:
        p.link.wait_sends()
    assert not in_flight[0] and not in_flight[1]
