"""One stage's share of a fused pipeline schedule (rlhfuse.txt §5): two models' train passes in one order.

Two models train on the same devices, each on its own pipeline (the second in reverse stage order; see
csrc/fused_schedule.h); ``orders`` lists each stage group's passes as ``(model, backward, micro-batch)`` in the
order the schedule search chose (``realloc._C.FusedProblem.search``). ``fused_protocol.build_programs`` turns
them into each group's program of posted receives, passes and posted sends, in an order that cannot deadlock
even where a send completes only when its receive is posted and one link's messages complete in the order
posted (NCCL), and that both sides of a link post alike (NCCL matches messages by order, gloo by tag). Each
model has its own ``StageLink`` on its own stage order, with its own tags (``StageLink(tag_offset=...)``),
so on gloo the two models' messages between the same two devices never match each other.

Each model's forwards and backwards run in micro-batch order, so its gradients accumulate in the order
1F1B accumulates them and its optimizer step sees the same gradients as unfused.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist

from realloc.models.fused_protocol import Op, build_programs
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


def run_fused(orders: Sequence[Sequence[tuple[int, int, int]]], parts: Sequence[FusedPart],
              record: list[tuple[int, int, int, float, float]] | None = None) -> None:
    """Forward and backward of every micro-batch of both models, this device's share of the fused ``orders``
    (one list of passes per stage group, the first model's stage k on group k): its program from
    ``fused_protocol.build_programs``, run by :func:`run_program`."""
    if len(parts) != 2:
        raise ValueError(f"run_fused: fuses two models, got {len(parts)}")
    group = parts[0].link.groups.pp_rank
    if len(orders) != parts[0].link.groups.pp:
        raise ValueError(f"run_fused: {len(orders)} stage groups' orders for pp={parts[0].link.groups.pp}")
    check_order(orders[group], parts)
    run_program(build_programs(orders)[group], parts, record)


def run_program(program: Sequence[Op], parts: Sequence[FusedPart],
                record: list[tuple[int, int, int, float, float]] | None = None) -> None:
    """Run one stage group's program (``fused_protocol``): receives and sends posted without waiting, in the
    program's order, each pass waiting for its own receive; the sends waited at the end. Gradients accumulate
    in each model's parameters' ``.grad``. ``record``: gets each pass's (model, backward, micro-batch, start,
    end) in wall-clock seconds, from its input's arrival to its end (the timeline draws them)."""
    posted: dict[tuple[int, int, int], tuple[dist.Work, torch.Tensor]] = {}
    sending: list[tuple[dist.Work, torch.Tensor]] = []
    in_flight: list[list[tuple[torch.Tensor | None, torch.Tensor]]] = [[], []]
    outputs: dict[tuple[int, int, int], torch.Tensor] = {}
    for kind, m, backward, mb in program:
        part = parts[m]
        link, g = part.link, part.link.groups
        if kind == "recv":
            buf = torch.empty(tuple(part.activation_shape(mb)), dtype=link.dtype, device=link.device)
            src, tag = (g.next_stage_rank, link.backward_tag) if backward else (g.prev_stage_rank, link.forward_tag)
            posted[(m, backward, mb)] = (dist.irecv(buf, src=src, group=g.pp_group, tag=tag), buf)
        elif kind == "send":
            # a finished send's tensor is dropped, so a stage holds only the messages still in flight
            still = []
            for w, sent in sending:
                if w.is_completed():
                    w.wait()  # returns at once; raises if the send failed
                else:
                    still.append((w, sent))
            sending = still
            t = outputs.pop((m, backward, mb)).detach().contiguous()
            dst, tag = (g.prev_stage_rank, link.backward_tag) if backward else (g.next_stage_rank, link.forward_tag)
            sending.append((dist.isend(t, dst=dst, group=g.pp_group, tag=tag), t))
        else:
            got = posted.pop((m, backward, mb), None)
            if got is not None:
                got[0].wait()
            t0 = time.time()
            if not backward:
                x = None if got is None else got[1].requires_grad_(True)
                out = part.forward_step(mb, x)
                in_flight[m].append((x, out))
                if not g.is_last_stage:
                    outputs[(m, 0, mb)] = out
            else:
                x, out = in_flight[m].pop(0)
                torch.autograd.backward(out, grad_tensors=None if got is None else got[1])
                if not g.is_first_stage:
                    outputs[(m, 1, mb)] = x.grad
            if record is not None:
                record.append((m, backward, mb, t0, time.time()))
    for work, _ in sending:
        work.wait()
    assert not posted and not outputs and not in_flight[0] and not in_flight[1], "the program ran every pass"
