"""The estimator following the runtime's lighter KV-cache handling (issue 31): a finish of rows moves only the slots
written by then (``engine.row_drop_used``), a micro-batch's caches come uninitialized and their pages are faulted in
by the writes (``engine.kv_touch``); tables with only the older keys price exactly as before. Prices are checked
against hand-computed sums, and the counts they rest on against the runtime's own generate."""

from __future__ import annotations

import pytest
import torch

from realloc.lengths import ResponseLengths
from realloc.models.sampling import GenerationConfig
from realloc.strategy import ParallelStrategy as S

from cost_helpers import actor_timers, tiny_ppo_cost
from test_kv_alloc_cost import tiny_model  # noqa: F401 - a tp 1 tiny model in this process


def drop(b: int, s: int) -> float:
    return 1e-5 + 3e-8 * b * s  # seconds per layer: rows kept b, slots s


def touch(b: int, s: float) -> float:
    return 2e-5 + 1e-8 * b * s  # seconds per layer: rows b, slots touched s


@pytest.fixture(scope="module")
def model():
    return tiny_ppo_cost()


def test_each_finish_moves_the_slots_written_by_then(model):
    old, new = actor_timers(model, {"engine.row_drop": drop})[1], actor_timers(model, {"engine.row_drop_used": drop})[1]
    both = actor_timers(model, {"engine.row_drop": lambda b, s: 1.0, "engine.row_drop_used": drop})[1]
    ends, prompt, slots = (2, 5, 5, 9), 8, 8 + 16
    for s, layers in ((S(1, 1, 1), 4), (S(1, 1, 2), 2)):
        # rows of length 2 stop after step 1 (slots [0, 8 + 1) written, 3 rows kept), of length 5 after step 4
        want = layers * (drop(3, 8 + 1) + drop(1, 8 + 4))
        assert new.row_drops(s, ends, slots, prompt) == pytest.approx(want, rel=1e-12)
        assert both.row_drops(s, ends, slots, prompt) == pytest.approx(want, rel=1e-12)
        # a table from before the key: every finish at all slots, as before (and so without a prompt)
        assert old.row_drops(s, ends, slots, prompt) == pytest.approx(layers * (drop(3, slots) + drop(1, slots)))
        assert old.row_drops(s, ends, slots) == old.row_drops(s, ends, slots, prompt)
        assert new.row_drops(s, ends, slots) == 0.0


def test_a_micro_batch_pays_the_first_touch_of_the_slots_its_rows_write(model):
    plain, new = actor_timers(model, {"engine.kv_touch": touch})
    old = actor_timers(model, {"engine.kv_alloc": touch})[1]
    ends, prompt, slots, n_mbs = (1, 3, 3, 7), 8, 8 + 16, 2
    links = model.links(model.cluster.whole, S(1, 1, 1))

    def extra(timer):
        return (timer.generate_varied(S(1, 1, 1), links, 4, prompt, ends, n_mbs, slots=slots).time
                - plain.generate_varied(S(1, 1, 1), links, 4, prompt, ends, n_mbs, slots=slots).time)

    # a row of length e writes slots [0, 8 + e - 1): on average 8 + 14 / 4 - 1 over the 4 rows, 4 layers
    assert extra(new) == pytest.approx(n_mbs * 4 * touch(4, 8 + 14 / 4 - 1), rel=1e-9)
    assert extra(old) == pytest.approx(n_mbs * 4 * touch(4, slots), rel=1e-9)  # zero-filled whole caches
    assert plain.kv_alloc(S(1, 1, 1), 4, slots, 10.0) == 0.0  # nothing measured: nothing priced


def test_the_runtime_moves_and_touches_what_the_prices_count(monkeypatch, tiny_model):
    """A real generate of 6 prompts of 5 tokens with scheduled lengths: each drop_rows moves slots [0, 5 + e - 1)
    when the rows of length e finish, and the caches' written slots (NaN-filled at allocation to see them) are
    6 x (5 - 1) + the sum of the lengths."""
    from realloc.models import generation

    m, prompt = tiny_model, 5
    made, drops = [], []
    orig_new, orig_drop = m.stage.new_kv_caches, generation.drop_rows

    def new_kv_caches(b, n, **kw):
        caches = orig_new(b, n, **kw)
        for c in caches:
            c.k.fill_(float("nan"))
            c.v.fill_(float("nan"))
        made.append(caches)
        return caches

    monkeypatch.setattr(m.stage, "new_kv_caches", new_kv_caches)
    monkeypatch.setattr(generation, "drop_rows",
                        lambda caches, keep, used=None: drops.append((int(keep.sum()), used))
                        or orig_drop(caches, keep, used))
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(6)]
    cfg = GenerationConfig(max_new_tokens=9, seed=4, length_schedule=ResponseLengths.uniform(1, 9))
    out = generation.generate(m, prompts, cfg, n_mbs=1)
    ends = sorted(out.gen_lengths.tolist())
    assert len(set(ends)) > 2  # rows finish at several steps
    want = [(sum(e > x for e in ends), prompt + x - 1) for x in sorted(set(ends))[:-1]]
    assert drops == want
    (caches,) = made
    written = (~caches[0].k[:, 0, :, 0].isnan()).sum().item()
    assert written == 6 * (prompt - 1) + sum(ends)


# -- explicit attention masks in the memory model (estimator/mask_memory.py) ------------------------------------------


def _memory(cfg, kind, b, prompt, gen, s, recompute=False, lengths=None):
    import dataclasses

    from realloc.estimator.hardware import Precision
    from realloc.estimator.memory import Workload, stage_call_memory

    work = Workload(kind, n_seqs=b, n_steps=1, prompt_len=prompt, gen_len=gen)
    if lengths is not None:
        work = dataclasses.replace(work, lengths=lengths)
    bf16 = Precision.for_dtype("bf16")
    return stage_call_memory(cfg, work, s, 1, 0, bf16, recompute).activations


@pytest.mark.parametrize("recompute", [False, True])
def test_a_sliding_window_adds_its_mask_and_each_layers_bf16_copy(recompute):
    """Mistral-like tiny (4 layers, window 16), 2 rows of 32 + 32 tokens in bf16: the [2, 1, 64, 64] bool mask is
    8192 bytes, each layer's bf16 copy 16384; a train step keeps the 4 copies (recomputed: the mask and one copy)."""
    import dataclasses

    from realloc.api import InterfaceType as I
    from realloc.models.config import get_model_config

    plain = get_model_config("tiny")
    window = dataclasses.replace(plain, sliding_window=16)
    s = S(1, 1, 1)
    mask, copy = 2 * 64 * 64, 2 * 64 * 64 * 2
    train = mask + copy if recompute else 4 * copy + mask
    assert _memory(window, I.TRAIN_STEP, 2, 32, 32, s, recompute) - _memory(plain, I.TRAIN_STEP, 2, 32, 32, s,
                                                                              recompute) == train
    assert _memory(window, I.INFERENCE, 2, 32, 32, s) - _memory(plain, I.INFERENCE, 2, 32, 32, s) == mask + copy
    # generation: the prefill's [2, 1, 32, 32] window mask; a window no shorter than the rows adds nothing
    assert _memory(window, I.GENERATE, 2, 32, 32, s) - _memory(plain, I.GENERATE, 2, 32, 32, s) == 2 * 32 * 32
    wide = dataclasses.replace(plain, sliding_window=64)
    assert _memory(wide, I.TRAIN_STEP, 2, 32, 32, s) == _memory(plain, I.TRAIN_STEP, 2, 32, 32, s)


def test_packed_rows_add_their_segment_mask():
    """8 sequences of an 8-token prompt and 1..16 new tokens packed (``Workload.packed``) into fewer rows of the
    longest: the segment mask and its bf16 copy, against the same workload with fixed lengths (no mask)."""
    from realloc.api import InterfaceType as I
    from realloc.estimator.mask_memory import stage_mask_bytes
    from realloc.estimator.hardware import Precision
    from realloc.models.config import get_model_config

    cfg, bf16 = get_model_config("tiny"), Precision.for_dtype("bf16")
    # 3 rows of 20 tokens hold 8 sequences: one [3, 1, 20, 20] mask of 1200 bytes, 2400 a copy, 4 layers
    assert stage_mask_bytes(cfg, I.INFERENCE, 8, 8, (3, 20), bf16, 4, 1, False) == 1200 + 2400
    assert stage_mask_bytes(cfg, I.TRAIN_STEP, 8, 8, (3, 20), bf16, 4, 2, False) == 2 * 4 * 2400 + 1200
    assert stage_mask_bytes(cfg, I.TRAIN_STEP, 8, 8, (3, 20), bf16, 4, 2, True) == 2 * 1200 + 2400
    assert stage_mask_bytes(cfg, I.TRAIN_STEP, 8, 8, (8, 20), bf16, 4, 1, False) == 0  # a sequence a row: causal
    varied = ResponseLengths.uniform(1, 16)
    s = S(1, 1, 1)
    got = _memory(cfg, I.INFERENCE, 8, 8, 16, s, lengths=varied) - _memory(cfg, I.INFERENCE, 8, 8, 16, s)
    from realloc.estimator.memory import Workload

    rows, width = Workload(I.INFERENCE, n_seqs=8, n_steps=1, prompt_len=8, gen_len=16, lengths=varied).packed(8)
    assert rows < 8 and got == rows * width * width * 3


def test_sdpa_keeps_a_compute_dtype_copy_of_the_mask_per_layer(tiny_model):
    """The count the memory model rests on, from the model's own layers: a forward with autograd of a windowed
    (window 8) stage over 2 rows of 24 tokens saves one [2, 1, 24, 24] copy of the mask per layer, in the compute
    dtype; without the window (causal SDPA) none."""
    import dataclasses

    from realloc.models.llama import LlamaStage

    stage = tiny_model.stage
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).expand(2, 24)
    counts = {}
    for window in (None, 8):
        stage.cfg = dataclasses.replace(stage.cfg, sliding_window=window)
        saved = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                stage(ids, pos, None)
        finally:
            stage.cfg = dataclasses.replace(stage.cfg, sliding_window=None)
        counts[window] = [t.dtype for t in saved if tuple(t.shape) == (2, 1, 24, 24)]
    assert isinstance(stage, LlamaStage) and counts[None] == []
    assert counts[8] == [next(stage.parameters()).dtype] * len(stage.layers)
