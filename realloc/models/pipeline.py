"""Pipeline-parallel schedules over point-to-point sends between neighbouring stages.

We own the schedules instead of using megatron's (they allocate with
``device="cuda"``). Communication uses plain ``torch.distributed`` isend/irecv
on the model's pp group, which works on gloo (no batched p2p there) and NCCL:

- sends are posted asynchronously and waited at the end of the schedule, so a
  stage never blocks on a send and only receives can stall it;
- activations and gradients use different tags, so a message can never be taken
  for the other kind, even when the previous and next stage are the same peer
  (pp = 2) — the trap megatron's batched p2p falls into on gloo.

Schedules (realhf.txt §2 / Megatron's non-interleaved 1F1B):
- :func:`run_1f1b`: training, with ``min(pp - stage - 1, M)`` warm-up forwards, a
  steady phase alternating one forward and one backward, and a cool-down of the
  remaining backwards. At most ``pp - stage`` micro-batches keep activations.
- :func:`run_forward_only`: inference; each stage streams micro-batches forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from realloc.models.groups import ModelParallelGroups

FORWARD_TAG = 11
BACKWARD_TAG = 12


class StageLink:
    """Point-to-point traffic of one pipeline stage with its neighbours."""

    def __init__(self, groups: ModelParallelGroups, device: torch.device, dtype: torch.dtype) -> None:
        self.groups = groups
        self.device = device
        self.dtype = dtype
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _recv(self, shape: Sequence[int], src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        dist.irecv(buf, src=src, group=self.groups.pp_group, tag=tag).wait()
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        t = tensor.detach().contiguous()
        self._pending.append((dist.isend(t, dst=dst, group=self.groups.pp_group, tag=tag), t))

    def recv_forward(self, shape: Sequence[int]) -> torch.Tensor:
        return self._recv(shape, self.groups.prev_stage_rank, FORWARD_TAG)

    def send_forward(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.groups.next_stage_rank, FORWARD_TAG)

    def recv_backward(self, shape: Sequence[int]) -> torch.Tensor:
        return self._recv(shape, self.groups.next_stage_rank, BACKWARD_TAG)

    def send_backward(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.groups.prev_stage_rank, BACKWARD_TAG)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


# forward_step(mb_index, input activation or None on the first stage) -> output activation, or on the last
# stage the scalar to backpropagate (the micro-batch's weighted loss).
ForwardStep = Callable[[int, "torch.Tensor | None"], torch.Tensor]
ShapeFn = Callable[[int], Sequence[int]]


def run_1f1b(link: StageLink, n_mbs: int, forward_step: ForwardStep, activation_shape: ShapeFn) -> None:
    """Forward and backward of ``n_mbs`` micro-batches; gradients accumulate in the parameters' ``.grad``."""
    g = link.groups
    first, last = g.is_first_stage, g.is_last_stage
    in_flight: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (input, output) awaiting backward

    def forward(i: int) -> None:
        x = None
        if not first:
            x = link.recv_forward(activation_shape(i)).requires_grad_(True)
        out = forward_step(i, x)
        if not last:
            link.send_forward(out)
        in_flight.append((x, out))

    def backward(i: int) -> None:
        x, out = in_flight.pop(0)
        if last:
            torch.autograd.backward(out)
        else:
            grad = link.recv_backward(activation_shape(i))
            torch.autograd.backward(out, grad_tensors=grad)
        if not first:
            link.send_backward(x.grad)

    warmup = min(g.pp - g.pp_rank - 1, n_mbs)
    for i in range(warmup):
        forward(i)
    for i in range(n_mbs - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(n_mbs - warmup, n_mbs):
        backward(i)
    link.wait_sends()
    assert not in_flight


def run_forward_only(link: StageLink, n_mbs: int, forward_step: ForwardStep,
                     activation_shape: ShapeFn) -> list[torch.Tensor]:
    """Forward of ``n_mbs`` micro-batches; returns the last stage's outputs (empty list on other stages)."""
    g = link.groups
    outputs = []
    for i in range(n_mbs):
        x = None if g.is_first_stage else link.recv_forward(activation_shape(i))
        out = forward_step(i, x)
        if g.is_last_stage:
            outputs.append(out)
        else:
            link.send_forward(out)
    link.wait_sends()
    return outputs
