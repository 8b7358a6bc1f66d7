"""Decoding with static shapes, replayed as one CUDA graph per step on GPUs (pp = 1).

A decode step runs a few kernels per layer on one token per sequence, so on a GPU it is bound by kernel
launches, not by arithmetic: ReaLHF captures the step in a CUDA graph and replays it (realhf.txt §6, "we use
CUDA graphs for generation"), and the estimator's GPU decode times assume it. A graph replays fixed kernels on
fixed addresses, so the step here changes nothing in shape from one token to the next:

- the micro-batch keeps all its rows until every row has finished (a finished row keeps decoding, its
  tokens are dropped), instead of the eager path's shrinking batch (``generation._MicroBatch.apply``);
- the KV caches have a fixed length, ``P + max_new_tokens`` rounded up to ``CACHE_BUCKET`` slots, and every
  step attends to all of them under a mask of the slots written so far;
- the step's inputs (last tokens, positions, the cache slot to write) live in device buffers the step reads
  and the loop updates in place; the slot is a device tensor, so the write is an ``index_copy_`` the graph
  replays at whatever slot the buffer names.

Sampling runs outside the graph but on the device: the uniforms of every row's generator are drawn for all
steps at the start (one host-to-device copy per micro-batch; a row's t-th draw is what the eager path draws at
its step t, so the tokens agree), and the host learns whether all rows finished once every ``CHECK_EVERY``
steps (one synchronization per that many tokens, not one per token).

One graph is captured per (rows, cache length) inside a ``generate()`` call and reused by its micro-batches of
that shape; it and its caches are freed when the call returns, so nothing is held between calls beyond what the
estimator's memory model counts for a generation. Without CUDA, or with ``GenerationConfig.decode="static"``,
the same step runs op by op: that path is the reference the graph's tokens are compared with bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Callable, Protocol

import torch

from realloc.models.config import ModelConfig
from realloc.models.groups import ModelParallelGroups
from realloc.models.llama import KVCache, LlamaStage, cache_mask
from realloc.models.sampling import GenerationConfig, sample_from_uniforms
from realloc.models.vocab_parallel import gather_vocab


class DecodingModel(Protocol):
    """What generation reads of a model; ``engine.ParallelModel`` is one (``generation.py`` re-exports it)."""

    cfg: ModelConfig
    groups: ModelParallelGroups
    device: torch.device
    dtype: torch.dtype
    stage: LlamaStage


class MicroBatchState(Protocol):
    """What a static decode reads and fills of one micro-batch (``generation._MicroBatch``)."""

    model: DecodingModel
    gconfig: GenerationConfig
    rows: list[torch.Tensor]
    P: int  # longest prompt: prompts are left-padded into slots [0, P)
    N: int  # max new tokens
    key_valid: torch.Tensor  # [rows, P + N] bool, real prompt tokens
    inputs: tuple  # the prefill's (ids, positions, mask, start)
    uniforms: torch.Tensor | None  # [rows, N] float64 each row's draws, on the device (None: greedy)
    plen_d: torch.Tensor  # [rows] prompt lengths, on the device
    eos: torch.Tensor
    out_tok: torch.Tensor  # [rows, N], filled
    out_lp: torch.Tensor
    gen_len: torch.Tensor
    hit_eos: torch.Tensor
    done: bool
    finished_step: int

# Cache lengths are rounded up to a multiple of this, so micro-batches of nearby prompt lengths share a graph.
CACHE_BUCKET = 64
# Steps between the host's checks that every row has finished (each check is one device synchronization).
CHECK_EVERY = 16


def wants_graph(model: DecodingModel, gconfig: GenerationConfig) -> bool:
    """Whether ``generate()`` decodes with a captured CUDA graph: on a GPU with one pipeline stage, unless the
    config asks otherwise (``decode``: "auto", "graph", "static" or "eager")."""
    if gconfig.decode in ("eager", "static"):
        return False
    on_gpu = model.device.type == "cuda" and model.groups.pp == 1
    if gconfig.decode == "graph" and not on_gpu:
        raise ValueError("GenerationConfig.decode='graph' needs a CUDA device and one pipeline stage (pp = 1); "
                         "use decode='auto' to fall back to eager decoding elsewhere")
    return on_gpu


def wants_static_op_by_op(model: DecodingModel, gconfig: GenerationConfig) -> bool:
    """Whether the config asks for the static-shape step without a graph (``decode="static"``)."""
    if gconfig.decode == "static" and model.groups.pp != 1:
        raise ValueError("GenerationConfig.decode='static' needs one pipeline stage (pp = 1); pipelined "
                         "generation decodes eagerly")
    return gconfig.decode == "static"


class StaticDecoder:
    """The buffers and (optionally) the CUDA graph of one decode step of ``rows`` sequences over ``length``
    cache slots; reused by every micro-batch of that shape in one ``generate()`` call."""

    def __init__(self, model: DecodingModel, rows: int, length: int, graph: bool) -> None:
        dev = model.device
        self.model, self.rows, self.length = model, rows, length
        self.caches: list[KVCache] = model.stage.new_kv_caches(rows, length)
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.key_valid = torch.zeros((rows, length), dtype=torch.bool, device=dev)
        self.logits = torch.zeros((rows, model.cfg.vocab_size), dtype=torch.float32, device=dev)
        self.want_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        """One token for every row: reads tokens/positions/slot/key_valid, writes the caches and ``logits``."""
        m, g = self.model, self.model.groups
        self.key_valid.index_fill_(1, self.slot, True)
        mask = self.key_valid.view(self.rows, 1, 1, self.length)
        h = m.stage.embed(self.tokens)
        h = m.stage.run_layers(h, self.positions, mask, self.caches, self.slot)
        logits = gather_vocab(m.stage.head(h), g.tp_group)[:, 0, :m.cfg.vocab_size]
        self.logits.copy_(logits)

    def step(self) -> None:
        if not self.want_graph:
            self._step()
            return
        if self.graph is None:
            self._capture()
            return  # the capture's warm-up run computed this step
        self.graph.replay()

    def _capture(self) -> None:
        # The warm-up computes this step: it writes the same slot with the same values as a replay would.
        try:
            self.graph = capture_graph(self._step, self.model.device)
        except GraphCaptureError as e:  # e.g. a collective backend that cannot be captured
            warnings.warn(f"CUDA-graph capture of the decode step failed ({e}); decoding op by op", stacklevel=2)
            self.want_graph = False


class GraphCaptureError(RuntimeError):
    """The capture failed; the warm-up run before it had run (and its effects stand)."""


def capture_graph(run: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``run`` once on a side stream (the warm-up torch.cuda.graphs asks for: the allocator and cuBLAS settle
    there; its effects are real), then captured as a CUDA graph to replay. The runtime's decode steps and the
    profiler's timing of them (``estimator/profiler.py``) both capture so."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except RuntimeError as e:
        raise GraphCaptureError(str(e)) from e
    return graph


def decode_static(mb: MicroBatchState, decoders: dict[tuple[int, int], StaticDecoder], graph: bool) -> None:
    """Generate micro-batch ``mb`` (pp = 1) with a static-shape step; fills ``mb``'s outputs as the eager
    path does (``out_tok``, ``out_lp``, ``gen_len``, ``hit_eos``)."""
    model, gconfig = mb.model, mb.gconfig
    rows, P, N = len(mb.rows), mb.P, mb.N
    # positions are per row (prompt length + step), so slots past P + N only round the shape up
    length = -(-(P + N) // CACHE_BUCKET) * CACHE_BUCKET
    key = (rows, length)
    if key not in decoders:
        decoders[key] = StaticDecoder(model, rows, length, graph)
    dec = decoders[key]
    dev = model.device
    # prefill, op by op: the left-padded prompts fill slots [0, P) of the decoder's caches
    dec.key_valid.zero_()
    dec.key_valid[:, :P] = mb.key_valid[:, :P]
    ids, positions, _, _ = mb.inputs
    h = model.stage.embed(ids) if model.groups.is_first_stage else None
    h = model.stage.run_layers(h, positions, cache_mask(dec.key_valid[:, :P], 0, P), dec.caches, 0)
    logits = gather_vocab(model.stage.head(h[:, -1:]), model.groups.tp_group)[:, 0, :model.cfg.vocab_size].float()
    u = mb.uniforms
    finished = torch.zeros(rows, dtype=torch.bool, device=dev)
    dec.positions.copy_((mb.plen_d - 1).view(rows, 1))
    dec.slot.fill_(P - 1)
    for t in range(N):
        if t > 0:
            dec.step()
            logits = dec.logits
        ban = mb.eos if t < gconfig.min_new_tokens else None
        tok, lp = sample_from_uniforms(logits, gconfig, None if u is None else u[:, t], ban)
        live = ~finished
        mb.out_tok[:, t] = torch.where(live, tok, gconfig.pad_token_id)
        mb.out_lp[:, t] = torch.where(live, lp, 0.0)
        mb.gen_len += live.long()
        stop = (torch.isin(tok, mb.eos) if mb.eos.numel() else torch.zeros_like(live)) & live
        mb.hit_eos |= stop
        finished |= stop
        if t == N - 1 or ((t + 1) % CHECK_EVERY == 0 and bool(finished.all())):
            break
        # the next step's inputs: this step's tokens at the next slot and position
        dec.tokens.copy_(tok.view(rows, 1))
        dec.positions.add_(1)
        dec.slot.add_(1)
    mb.done, mb.finished_step = True, t
