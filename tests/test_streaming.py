"""Streaming and long-tail migration (issue 31 items 2 and 3, docs/streaming.md): generation stopped at the
migration point and continued elsewhere after a re-run prefill gives the unmigrated tokens; migrated and streamed
runs give the unmigrated run's samples, rewards, losses and final parameters."""

from __future__ import annotations

import pytest
import torch

from mp_pool import GlooPool
from model_helpers import build_model
from realloc.lengths import ResponseLengths
from realloc.models.config import get_model_config
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig

SCHEDULE = ResponseLengths.lognormal(median=3, p99=30)
N_ROWS, MAX_NEW = 12, 24


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 64, (n,), generator=g) for n in (3, 7, 1, 5, 9, 2, 6, 4, 2, 8, 5, 3)]


def _responses(out):
    return [(out.sequences[b, out.prompt_lengths[b]:out.lengths[b]].tolist(),
             out.logprobs[b, out.prompt_lengths[b]:out.lengths[b]]) for b in range(out.lengths.numel())]


def _two_phases(ctx, gconfig, threshold, n_mbs):
    """On one replica: plain generation, and phase 1 to ``threshold`` rows then phase 2 on the rest."""
    from realloc.models.tail_decode import continue_decoding, decode_until

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=3)
    if model is None:
        return None
    rows = _prompts()
    plain = _responses(model.generate([r.tolist() for r in rows], gconfig, seq_ids=range(N_ROWS), n_mbs=n_mbs))
    counts = []
    one = decode_until(model, rows, gconfig, range(N_ROWS), n_mbs, lambda n: counts.append(n) or n, threshold)
    got = dict(zip(one.finished, _responses(one.output)))
    tail_ids = one.tail.seq_ids
    if tail_ids:
        got.update(zip(tail_ids, _responses(continue_decoding(model, one.tail, gconfig, n_mbs=2))))
    return plain, [got[i] for i in range(N_ROWS)], one.step, counts, tail_ids


@pytest.mark.parametrize("eos,n_mbs", [((40, 41), 1), ((), 3)])
def test_a_tail_continued_after_a_rerun_prefill_gives_the_unmigrated_tokens(pool, eos, n_mbs):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=eos, temperature=0.9,
                               length_schedule=SCHEDULE)
    plain, migrated, step, counts, tail_ids = next(r for r in pool.run(_two_phases, gconfig, 3, n_mbs) if r)
    lengths = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    # the migration point: the first step after which at most 3 rows are unfinished (by the schedule's lengths)
    want_step = min(t for t in range(MAX_NEW) if sum(n > t + 1 for n in lengths) <= 3)
    assert step == want_step and counts[-1] == len(tail_ids) <= 3 and len(counts) == step + 1
    assert sorted(tail_ids) == [i for i, n in enumerate(lengths) if n > step + 1] and tail_ids
    assert [len(t) for t, _ in migrated] == lengths
    for (a, lpa), (b, lpb) in zip(plain, migrated):
        assert a == b
        assert torch.allclose(lpa, lpb, atol=1e-5)
