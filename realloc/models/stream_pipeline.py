"""A split generation's decode step at pp > 1 (``stream_decode.SplitGeneration``; docs/tail-semantics.md, Limits).

At pp 1 every micro-batch advances one step per round, so "step t" is one moment on every dp replica, and the
replicas count their running rows after each step to find the split point. At pp > 1 ``generation._pipelined``
starts micro-batches in waves and lets a stage learn the tokens of micro-batch i's step t while it already works on
step t + 1 of earlier ones, so a stage never knows the count of one step before it runs the next. Here every
micro-batch is in flight from the first step, and a step is: every micro-batch through this stage (stage k works on
micro-batch i while stage k + 1 works on i - 1, as in the pipelined loop), then, on every stage but the last, the
tokens of that step of every micro-batch (the last stage sampled them). After a step every stage of the replica
holds the same tokens and knows the same running rows, so each stage's count over its dp group (the stage's ranks
of every replica) finds the same split point, and every stage stops after the same step with no message in flight
(the step's sends are waited for at its end): a stream can pause there between two requests and continue in place.
Every micro-batch computes what it would alone, so the tokens are those of ``generation.generate`` at any pp.
"""

from __future__ import annotations

import torch

from realloc.models.generation import TOKENS_TAG, _MicroBatch, _Wire, stage_pass
from realloc.models.static_decode import DecodingModel


def pipelined_step(model: DecodingModel, mbs: list[_MicroBatch], wire: _Wire, t: int) -> None:
    """Step ``t`` of every unfinished micro-batch on this stage (module docstring)."""
    g = model.groups
    live = [(i, mb) for i, mb in enumerate(mbs) if not mb.done]  # the same on every stage: they share the tokens
    for i, mb in live:
        stage_pass(model, mb, i, t, wire)
    if not g.is_last_stage:
        for _, mb in live:
            mb.apply(wire.recv((2, mb.n_active), torch.float64, g.last_stage_rank, TOKENS_TAG), t)
    wire.finish()  # every send of this step has arrived: nothing in flight if the decoding pauses here
