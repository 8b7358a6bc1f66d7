"""Explicit attention masks in a call's memory: the [rows, 1, T, T] bool masks the model builds for packed rows
(``llama.segment_mask``, several sequences in a row) and for a sliding window (``llama.window_mask``, Mistral, rows
longer than the window), and the copy SDPA makes of such a mask in the compute dtype.

What the code paths allocate (``models/engine.py`` forward and train_step, ``models/llama.py``):

- the mask itself, 1 byte an element, built once per micro-batch and passed to every layer; with a window it is the
  window's ``base & near`` (the segment mask or the causal one before it, and ``near``, are gone once the layers run);
- in every layer given the mask, ``F.scaled_dot_product_attention`` turns the bool mask into an additive one of the
  compute dtype (e bytes an element) and, with autograd on, saves it for the backward: one copy per such layer kept
  until the micro-batch's backward (counted here on torch's CPU kernel with ``saved_tensors_hooks``:
  tests/test_est_follow.py). Without an explicit mask the layers run causal SDPA and neither exists. With windows in
  only some layers (``ModelConfig.full_attention_layers``: Qwen2/Qwen3 ``layer_types``) and a sequence a row, the
  stage still builds the window's mask (``LlamaStage.run_layers``), but only its windowed layers take it; the full
  ones run causal SDPA without a copy. Packed rows give every layer a mask (the segment one or the window's).

Generation (``models/generation.py``): the prefill runs on its left-padding mask, ``llama.cache_mask``'s
[b, 1, P, P] bool, with or without a window; its first forward builds it and drops it when it returns, so one exists
on a stage at a time (micro-batches in flight included), and each layer's SDPA makes its compute-dtype copy (one at a
time: no autograd keeps it). A prompt longer than the window adds the window's [b, 1, P, P] ``base & near`` beside
it (the copy is then of that one). The decode steps' masks are one query wide (b (P + N) bytes), not counted.
"""

from __future__ import annotations

from realloc.calls import InterfaceType
from realloc.estimator.hardware import Precision
from realloc.models.config import ModelConfig


def explicit_mask_shape(cfg: ModelConfig, rows: int, width: int, packed: bool) -> tuple[int, int] | None:
    """(rows, T) of the [rows, 1, T, T] mask a micro-batch of ``rows`` rows of ``width`` tokens runs on, or None when
    causal attention suffices (one sequence a row and no window shorter than the row)."""
    window = cfg.sliding_window is not None and width > cfg.sliding_window
    return (rows, width) if packed or window else None


def mask_bytes(shape: tuple[int, int] | None, precision: Precision) -> tuple[int, int]:
    """(the bool mask's bytes, one layer's compute-dtype copy's bytes) of a mask of ``shape``; (0, 0) for none."""
    if shape is None:
        return 0, 0
    rows, t = shape
    return rows * t * t, rows * t * t * precision.param


def masked_layers(cfg: ModelConfig, layers: range, width: int, packed: bool) -> int:
    """How many of the stage's ``layers`` run SDPA on an explicit mask (and so make its copy): every layer with packed
    rows, else the windowed ones when rows are longer than the window, else none (module docstring)."""
    if packed:
        return len(layers)
    if cfg.sliding_window is None or width <= cfg.sliding_window:
        return 0
    return sum(1 for i in layers if cfg.windowed(i))


def train_mask_bytes(shape: tuple[int, int] | None, precision: Precision, n_blocks: int, in_flight: int,
                     recompute: bool) -> int:
    """Peak mask bytes of a train step: each in-flight micro-batch keeps the saved copies of its ``n_blocks`` masked
    layers (recomputation: only the bool mask, a checkpointed layer's input, and the block being recomputed its
    copy); without recomputation the micro-batch at work also holds its bool mask while its forward runs."""
    held, copy = mask_bytes(shape, precision)
    if recompute:
        return in_flight * held + (copy if n_blocks else 0)
    return in_flight * n_blocks * copy + held


def stage_mask_bytes(cfg: ModelConfig, interface: InterfaceType, b: int, prompt_len: int, packed: tuple[int, int],
                     precision: Precision, n_blocks: int, in_flight: int, recompute: bool, first_layer: int = 0) -> int:
    """The mask bytes a call adds to a stage's activations (module docstring), for micro-batches of ``b`` sequences
    with prompts of ``prompt_len`` tokens, run as ``packed`` (rows, tokens a row: ``Workload.packed``; fewer rows
    than sequences: some rows hold several), on the stage's ``n_blocks`` layers from ``first_layer``."""
    if interface is InterfaceType.GENERATE:
        # the prefill's: built by its forward and gone after it, whichever micro-batches hold caches
        padding, copy = mask_bytes((b, prompt_len), precision)  # cache_mask, always explicit
        held, _ = mask_bytes(explicit_mask_shape(cfg, b, prompt_len, False), precision)  # the window's
        return padding + held + copy
    rows, width = packed
    shape = explicit_mask_shape(cfg, rows, width, rows < b)
    masked = masked_layers(cfg, range(first_layer, first_layer + n_blocks), width, rows < b)
    if interface is InterfaceType.TRAIN_STEP:
        return train_mask_bytes(shape, precision, masked, in_flight, recompute)
    held, copy = mask_bytes(shape, precision)
    return held + (copy if masked else 0)  # a forward: the mask and one masked layer's copy at a time
