"""Pipeline-parallel schedules over point-to-point sends between neighbouring stages.

We own the schedules instead of using megatron's (they allocate with
``device="cuda"``). Communication uses plain ``torch.distributed`` isend/irecv
on the model's pp group, which works on gloo (no batched p2p there) and NCCL:

- on gloo, sends are posted asynchronously and waited at the end of the schedule,
  so a stage never blocks on a send and only receives can stall it;
- on NCCL (p2p kernels run in stream order), the steady phase posts each send
  together with the receive that follows it in one ``batch_isend_irecv``, as
  Megatron does; this path is not exercised by the CPU test suite;
- activations and gradients use different tags, so a message can never be taken
  for the other kind, even when the previous and next stage are the same peer
  (pp = 2) — the trap megatron's batched p2p falls into on gloo.

Schedules (realhf.txt §2 / Megatron's non-interleaved 1F1B):
- :func:`run_1f1b`: training, with ``min(pp - stage - 1, M)`` warm-up forwards, a
  steady phase alternating one forward and one backward, and a cool-down of the
  remaining backwards. At most ``pp - stage`` micro-batches keep activations.
- :func:`run_forward_only`: inference; each stage streams micro-batches forward.

What crosses stages is whatever the caller's ``activation_shape`` says: ``[B, T, h]``, or under sequence
parallelism the rank's ``[local, h]`` tokens (``engine.ParallelModel._hidden_shape``), 1/tp of the bytes; each
tp rank sends its share to the same tp rank of the next stage.
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

    def __init__(self, groups: ModelParallelGroups, device: torch.device, dtype: torch.dtype,
                 tag_offset: int = 0) -> None:
        self.groups = groups
        self.device = device
        self.dtype = dtype
        # Two models whose pipelines share devices (fused_pipeline.py) tag their messages apart.
        self.forward_tag, self.backward_tag = FORWARD_TAG + tag_offset, BACKWARD_TAG + tag_offset
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        # NCCL runs p2p as kernels in stream order, so a send that waits for its receiver can block a
        # later receive; posting the pair in one batch avoids it. gloo has no batched p2p, but its
        # sends never block us (they are waited at the end), so it posts them one by one.
        self._batched = dist.get_backend(groups.pp_group) == "nccl"

    def _buffer(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=self.dtype, device=self.device)

    def _recv(self, shape: Sequence[int], src: int, tag: int) -> torch.Tensor:
        buf = self._buffer(shape)
        dist.irecv(buf, src=src, group=self.groups.pp_group, tag=tag).wait()
        return buf

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        # A pending send keeps its tensor alive: drop the ones the peer has received, so a stage holds the
        # activations of the last micro-batches it sent, not of every micro-batch until the schedule ends.
        still = []
        for work, sent in self._pending:
            if work.is_completed():
                work.wait()  # returns at once; raises if the send failed
            else:
                still.append((work, sent))
        self._pending = still
        t = tensor.detach().contiguous()
        self._pending.append((dist.isend(t, dst=dst, group=self.groups.pp_group, tag=tag), t))

    def _send_recv(self, tensor: torch.Tensor, dst: int, send_tag: int, shape: Sequence[int], src: int,
                   recv_tag: int) -> torch.Tensor:
        if not self._batched:
            self._send(tensor, dst, send_tag)
            return self._recv(shape, src, recv_tag)
        t, buf = tensor.detach().contiguous(), self._buffer(shape)
        ops = [dist.P2POp(dist.isend, t, dst, self.groups.pp_group, send_tag),
               dist.P2POp(dist.irecv, buf, src, self.groups.pp_group, recv_tag)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return buf

    def recv_forward(self, shape: Sequence[int]) -> torch.Tensor:
        return self._recv(shape, self.groups.prev_stage_rank, self.forward_tag)

    def send_forward(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.groups.next_stage_rank, self.forward_tag)

    def recv_backward(self, shape: Sequence[int]) -> torch.Tensor:
        return self._recv(shape, self.groups.next_stage_rank, self.backward_tag)

    def send_backward(self, tensor: torch.Tensor) -> None:
        self._send(tensor, self.groups.prev_stage_rank, self.backward_tag)

    def send_forward_recv_backward(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        nxt = self.groups.next_stage_rank
        return self._send_recv(tensor, nxt, self.forward_tag, shape, nxt, self.backward_tag)

    def send_backward_recv_forward(self, tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        prev = self.groups.prev_stage_rank
        return self._send_recv(tensor, prev, self.backward_tag, shape, prev, self.forward_tag)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


# forward_step(mb_index, input activation or None on the first stage) -> output activation, or on the last
# stage the scalar to backpropagate (the micro-batch's weighted loss).
ForwardStep = Callable[[int, "torch.Tensor | None"], torch.Tensor]
ShapeFn = Callable[[int], Sequence[int]]


def run_1f1b(link: StageLink, n_mbs: int, forward_step: ForwardStep, activation_shape: ShapeFn) -> None:
    """Forward and backward of ``n_mbs`` micro-batches; gradients accumulate in the parameters' ``.grad``.

    In the steady phase each stage pairs the send of a forward output with the receive of the
    gradient it will need next, and the send of an input gradient with the receive of the next
    input (Megatron's send_forward_recv_backward / send_backward_recv_forward).
    """
    g = link.groups
    first, last = g.is_first_stage, g.is_last_stage
    in_flight: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (input, output) awaiting backward

    def recv_input(i: int) -> torch.Tensor | None:
        return None if first else link.recv_forward(activation_shape(i))

    def run_forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is not None:
            x.requires_grad_(True)
        out = forward_step(i, x)
        in_flight.append((x, out))
        return out

    def run_backward(grad: torch.Tensor | None) -> torch.Tensor | None:
        x, out = in_flight.pop(0)
        if last:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, grad_tensors=grad)
        return None if first else x.grad

    warmup = min(g.pp - g.pp_rank - 1, n_mbs)
    steady = n_mbs - warmup
    for i in range(warmup):
        out = run_forward(i, recv_input(i))
        link.send_forward(out)
    x = recv_input(warmup) if steady > 0 else None
    for j in range(steady):
        i = warmup + j  # forward micro-batch; backward micro-batch is j
        out = run_forward(i, x)
        grad = None if last else link.send_forward_recv_backward(out, activation_shape(j))
        dx = run_backward(grad)
        if j == steady - 1:
            if not first:
                link.send_backward(dx)
        elif first:
            x = None
        else:
            x = link.send_backward_recv_forward(dx, activation_shape(i + 1))
    for j in range(steady, n_mbs):
        grad = None if last else link.recv_backward(activation_shape(j))
        dx = run_backward(grad)
        if not first:
            link.send_backward(dx)
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
