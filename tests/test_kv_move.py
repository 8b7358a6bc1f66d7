"""A long-tail migration that moves KV caches (issue 31 item 3; models/kv_move.py, docs/streaming.md "Moving the KV
caches"): the tail decodes on from phase 1's caches, cut at the migration point, with no prefill re-run. Against
the unmigrated generation of the same rows: bit for bit where the tail replica decodes one source micro-batch's
rows (the unmigrated run's very operations), the tokens and log-probs within float tolerance where rows of several
micro-batches decode together (another batch size); the sliding window (Mistral) and rows that phase 1 decoded
past the migration point included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_helpers import build_model
from realloc.models.config import get_model_config
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_length_schedule import _prompts as _prompt_lists
from test_tail_runahead import _LateCounts

GCONFIG = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                           length_schedule=SCHEDULE)


def _config(window: int | None):
    cfg = get_model_config("tiny")
    return cfg if window is None else dataclasses.replace(cfg, sliding_window=window)


def _responses(out):
    return [(out.sequences[b, out.prompt_lengths[b]:out.lengths[b]].tolist(),
             out.logprobs[b, out.prompt_lengths[b]:out.lengths[b]]) for b in range(out.lengths.numel())]


def _moved_on_one_replica(ctx, window, n_mbs, threshold, lag):
    """Plain generation, and phase 1 (counts ``lag`` steps late) then the tail decoded from its cut caches."""
    from realloc.models.kv_move import cut_row, decode_moved
    from realloc.models.tail_decode import SyncCounts, decode_until

    model = build_model(ctx, _config(window), 1, 1, 1, seed=3)
    if model is None:
        return None
    rows = [torch.tensor(p) for p in _prompt_lists()]
    plain = _responses(model.generate([r.tolist() for r in rows], GCONFIG, seq_ids=range(N_ROWS), n_mbs=n_mbs))
    counts = SyncCounts(lambda n: n) if lag == 0 else _LateCounts(lag)
    one = decode_until(model, rows, GCONFIG, range(N_ROWS), n_mbs, counts, threshold)
    got = dict(zip(one.finished, _responses(one.output)))
    if one.ahead:
        got.update(zip(one.ahead, _responses(one.ahead_output)))
    held = sorted(one.held)
    width = max(one.held[i][2] for i in held)
    caches = [cut_row(one.held[i][0], one.held[i][1], one.held[i][2], rows[i].numel(), one.step) for i in held]
    caches = [[(k.clone(), v.clone()) for k, v in kv] for kv in caches]  # as if moved: copies
    pos = [one.tail.seq_ids.index(i) for i in held]
    out = decode_moved(model, [rows[i] for i in held], held, one.tail.tokens[pos], one.tail.logprobs[pos], caches,
                       width, GCONFIG)
    got.update(zip(held, _responses(out)))
    return plain, [got[i] for i in range(N_ROWS)], held, one.ahead, one.step


@pytest.mark.parametrize("window", [None, 4])
def test_one_micro_batchs_moved_tail_is_the_unmigrated_run_bit_for_bit(pool, window):
    plain, moved, held, ahead, step = next(r for r in pool.run(_moved_on_one_replica, window, 1, 3, 0) if r)
    assert step >= 1 and held and not ahead
    for i, ((a, lpa), (b, lpb)) in enumerate(zip(plain, moved)):
        assert a == b and torch.equal(lpa, lpb), i


@pytest.mark.parametrize("window,n_mbs,lag", [(None, 3, 0), (4, 2, 0), (None, 1, 10), (4, 1, 10)])
def test_rows_of_several_micro_batches_or_decoded_past_the_point_keep_their_tokens(pool, window, n_mbs, lag):
    plain, moved, held, ahead, step = next(r for r in pool.run(_moved_on_one_replica, window, n_mbs, 4, lag) if r)
    assert held and (ahead if lag else True)
    for i, ((a, lpa), (b, lpb)) in enumerate(zip(plain, moved)):
        assert a == b and torch.allclose(lpa, lpb, atol=1e-5), i
        if i in ahead:  # finished by phase 1 past the migration point: kept as decoded, bit for bit
            assert torch.equal(lpa, lpb), i
