"""A generation stopped at a split point and continued in place (models/stream_decode.py, issue 31 item 2) gives
exactly the plain generation's tokens and log-probs, and stops where the threshold says."""

from __future__ import annotations

import pytest
import torch

from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_streaming import _responses, model_and_plain


def _split_and_continue(ctx, gconfig, threshold, n_mbs):
    from realloc.models.stream_decode import SplitGeneration

    got = model_and_plain(ctx, gconfig, n_mbs)
    if got is None:
        return None
    model, rows, plain = got
    gen = SplitGeneration(model, rows, gconfig, range(N_ROWS), n_mbs)
    counts = []
    split = gen.until(lambda n: counts.append(n) or n, threshold)
    running = gen.running()
    finished = [i for i in range(N_ROWS) if i not in running]
    early = dict(zip(finished, _responses(gen.output(finished))))
    gen.finish()
    late = dict(zip(running, _responses(gen.output(running))))
    return plain, {**early, **late}, split, counts, running


@pytest.mark.parametrize("eos,n_mbs", [((40, 41), 1), ((), 3)])
def test_a_split_generation_continued_in_place_is_the_plain_one(pool, eos, n_mbs):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=eos, temperature=0.9,
                               length_schedule=SCHEDULE)
    plain, got, split, counts, running = next(r for r in pool.run(_split_and_continue, gconfig, 3, n_mbs) if r)
    lengths = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    want_step = min(t for t in range(MAX_NEW) if sum(n > t + 1 for n in lengths) <= 3)
    assert split and len(counts) == want_step + 1 and counts[-1] == len(running) <= 3
    assert running == [i for i, n in enumerate(lengths) if n > want_step + 1] and running
    for i, (tok, lp) in enumerate(plain):  # bit for bit: the same decode steps, nothing re-run
        assert got[i][0] == tok and torch.equal(got[i][1], lp), i
