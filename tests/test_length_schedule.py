"""The seeded EOS schedule (issue 31, item 6): response lengths that follow a chosen distribution,
deterministically, in every layout."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from mp_pool import GlooPool
from model_helpers import build_model
from realloc.lengths import ResponseLengths
from realloc.models.config import get_model_config
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig

SCHEDULE = ResponseLengths.lognormal(median=3, p99=30)
EOS = (40, 41, 42)
N_ROWS, MAX_NEW = 12, 24


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 7, 1, 5, 9, 2, 6, 4, 2, 8, 5, 3)]


def _generate(ctx, dp, pp, gconfig, n_mbs=1):
    model = build_model(ctx, get_model_config("tiny"), dp, 1, pp, seed=3)
    if model is None:
        return None
    per = N_ROWS // dp
    lo = model.groups.dp_rank * per
    out = model.generate(_prompts()[lo:lo + per], gconfig, seq_ids=range(lo, lo + per), n_mbs=n_mbs)
    return {"dp": model.groups.dp_rank, "gen": [out.sequences[b, out.prompt_lengths[b]:out.lengths[b]].tolist()
                                                for b in range(per)],
            "logp": [out.logprobs[b, out.prompt_lengths[b]:out.lengths[b]] for b in range(per)],
            "eos": out.stopped_at_eos.tolist()}


def _rows(results):
    res = {r["dp"]: r for r in results if r is not None}
    return ([g for d in sorted(res) for g in res[d]["gen"]], [x for d in sorted(res) for x in res[d]["logp"]],
            [e for d in sorted(res) for e in res[d]["eos"]])


def test_the_schedule_draws_a_long_tail_that_depends_only_on_seed_and_sequence():
    lengths = scheduled_lengths(SCHEDULE, 512, seed=7, seq_ids=range(4000))
    assert lengths == scheduled_lengths(SCHEDULE, 512, seed=7, seq_ids=range(4000))
    assert lengths[100:200] == scheduled_lengths(SCHEDULE, 512, seed=7, seq_ids=range(100, 200))
    assert lengths != scheduled_lengths(SCHEDULE, 512, seed=8, seq_ids=range(4000))
    median, p99 = np.percentile(lengths, 50), np.percentile(lengths, 99)
    assert median == 3 and 25 <= p99 <= 36 and p99 >= 8 * median  # the distribution's: 3 and 30
    assert max(scheduled_lengths(SCHEDULE, 16, seed=7, seq_ids=range(4000))) == 16  # cut at max_new_tokens


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 1, 1), (1, 2, 2)])
def test_every_row_ends_with_eos_exactly_at_its_scheduled_length_in_every_layout(pool, layout):
    dp, pp, n_mbs = layout
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=EOS, temperature=0.9,
                               length_schedule=SCHEDULE)
    gen, logp, eos = _rows(pool.run(_generate, dp, pp, gconfig, n_mbs))
    want = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    assert [len(g) for g in gen] == want and len(set(want)) >= 4
    assert all(eos) and all(g[-1] == EOS[0] and not set(g[:-1]) & set(EOS) for g in gen)
    assert all(bool(torch.all(x < 0)) for x in logp)
    if layout != (1, 1, 1):  # the layout changes nothing
        ref_gen, ref_logp, _ = _rows(pool.run(_generate, 1, 1, gconfig, 1))
        assert gen == ref_gen
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(logp, ref_logp))


def test_without_eos_ids_a_scheduled_row_is_the_free_rows_prefix(pool):
    """No EOS to force (a random-init model on token ids): the schedule only cuts each row, so its tokens and
    log-probs are those of the same seed without a schedule, up to its length (log-probs up to the rounding of
    other batch shapes, as rows leave sooner)."""
    free = GenerationConfig(max_new_tokens=MAX_NEW, seed=5)
    cut = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, length_schedule=SCHEDULE)
    full_gen, full_logp, _ = _rows(pool.run(_generate, 1, 1, free))
    gen, logp, eos = _rows(pool.run(_generate, 1, 1, cut))
    want = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    assert [len(g) for g in gen] == want and not any(eos)
    assert all(len(f) == MAX_NEW for f in full_gen)
    for g, f, lp, flp in zip(gen, full_gen, logp, full_logp):
        assert g == f[:len(g)]
        assert torch.allclose(lp, flp[:len(g)], atol=1e-5)  # rows leave sooner: other batch shapes


def test_bad_schedule_settings_are_one_clear_error():
    from realloc.algorithms.common import generation_config
    from realloc.algorithms.critic_free.grpo import GRPOConfig

    with pytest.raises(ValueError, match="length_schedule must be a ResponseLengths"):
        GenerationConfig(max_new_tokens=4, length_schedule="lognormal")
    with pytest.raises(ValueError, match="length_schedule and min_new_tokens"):
        GenerationConfig(max_new_tokens=4, min_new_tokens=2, length_schedule=SCHEDULE)
    with pytest.raises(ValueError, match="runs the eager decode loop"):
        GenerationConfig(max_new_tokens=4, decode="graph", length_schedule=SCHEDULE)
    with pytest.raises(ValueError, match="GRPOConfig.length_schedule must be a ResponseLengths"):
        GRPOConfig(length_schedule=(3, 30))
    with pytest.raises(ValueError, match="GRPOConfig: length_schedule and min_new_tokens"):
        GRPOConfig(length_schedule=SCHEDULE, min_new_tokens=3)
    # the algorithm setting reaches sampled generation, not greedy evaluation
    ctx = types.SimpleNamespace(config=GRPOConfig(length_schedule=SCHEDULE), gen_len=32, greedy=False, seed=1,
                                purpose="gen", iteration=0, eos_token_ids=(2,), pad_token_id=0, vocab_limit=None)
    assert generation_config(ctx).length_schedule == SCHEDULE
    assert generation_config(types.SimpleNamespace(**{**vars(ctx), "greedy": True})).length_schedule is None
