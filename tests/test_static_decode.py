"""The static-shape decode step (static_decode.py): the step a CUDA graph captures, run op by op on CPU,
must give the eager shrinking-batch loop's tokens (bit for bit) and log-probs, in every pp = 1 layout."""

from __future__ import annotations

import pytest
import torch

from mp_pool import GlooPool, WorkerError
from model_helpers import build_model
from realloc.models.config import get_model_config
from realloc.models.sampling import GenerationConfig, draw_uniforms, sequence_generators


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _generate(ctx, cfg, dp, tp, pp, prompts, gconfig, n_mbs):
    model = build_model(ctx, cfg, dp, tp, pp, seed=3)
    if model is None:
        return None
    per = len(prompts) // dp
    lo = model.groups.dp_rank * per
    out = model.generate(prompts[lo:lo + per], gconfig, seq_ids=range(lo, lo + per), n_mbs=n_mbs)
    return {"dp": model.groups.dp_rank,
            "seqs": [out.sequences[b, :out.lengths[b]].tolist() for b in range(per)],
            "logp": [out.logprobs[b, :out.lengths[b]] for b in range(per)],
            "eos": out.stopped_at_eos.tolist(), "width": out.sequences.shape[1]}


def _by_replica(results):
    res = [r for r in results if r is not None]
    seqs, logp, eos = [], [], []
    for d in sorted({r["dp"] for r in res}):
        r = next(x for x in res if x["dp"] == d)
        seqs += r["seqs"]
        logp += r["logp"]
        eos += r["eos"]
    return seqs, logp, eos


PROMPT_LENS = (3, 7, 1, 5, 9, 2, 6, 4)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 1, 1, 3), (1, 2, 1, 2), (2, 1, 1, 1)])
def test_static_step_gives_the_eager_loops_tokens(pool, greedy, layout):
    """Rows stop at different steps (an eighth of the vocabulary is EOS), after min_new_tokens; variable
    prompt lengths; micro-batches of one shape share the decoder; dp and tp split the rows and heads."""
    cfg = get_model_config("tiny-gqa")
    dp, tp, pp, n_mbs = layout
    base = dict(max_new_tokens=20, min_new_tokens=2, seed=5, eos_token_ids=tuple(range(40, 48)), greedy=greedy,
                temperature=0.8, top_p=0.9)
    runs = {}
    for mode in ("eager", "static"):
        gconfig = GenerationConfig(**base, decode=mode)
        runs[mode] = _by_replica(pool.run(_generate, cfg, dp, tp, pp, _prompts(), gconfig, n_mbs))
    (seqs, logp, eos), (ref_seqs, ref_logp, ref_eos) = runs["static"], runs["eager"]
    assert seqs == ref_seqs
    assert eos == ref_eos
    for a, b in zip(logp, ref_logp):
        assert torch.allclose(a, b, atol=1e-5), (a, b)
    generated = [len(s) - n for s, n in zip(ref_seqs, PROMPT_LENS)]
    # the case is one where rows finish at different steps, some at EOS and some at the length limit
    assert min(generated) >= 2 and len(set(generated)) >= 3 and any(eos) and not all(eos), generated


def test_static_step_stops_every_row_at_its_own_eos_between_host_checks(pool):
    """All rows finish long before max_new_tokens: the loop ends at the first host check after the last
    EOS (static_decode.CHECK_EVERY), and nothing after a row's EOS reaches its output."""
    cfg = get_model_config("tiny")
    gconfig = dict(max_new_tokens=100, seed=2, eos_token_ids=tuple(range(0, 64, 2)))  # half the vocabulary
    got = {m: _by_replica(pool.run(_generate, cfg, 1, 1, 1, _prompts(), GenerationConfig(**gconfig, decode=m), 1))
           for m in ("eager", "static")}
    assert got["static"][0] == got["eager"][0]
    assert all(got["static"][2])  # every row stopped at an EOS
    assert max(len(s) - n for s, n in zip(got["static"][0], PROMPT_LENS)) < 30


def _bad_decode(ctx, mode, pp):
    cfg = get_model_config("tiny")
    model = build_model(ctx, cfg, 1, 1, pp, seed=3)
    model.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=2, decode=mode))


def test_graph_and_static_decoding_refuse_what_they_cannot_run(pool):
    with pytest.raises(WorkerError, match="decode='graph' needs a CUDA device"):
        pool.run(_bad_decode, "graph", 1)
    with pytest.raises(WorkerError, match="decode='static' needs one pipeline stage"):
        pool.run(_bad_decode, "static", 2)
    with pytest.raises(ValueError, match="GenerationConfig.decode must be one of"):
        GenerationConfig(max_new_tokens=2, decode="cuda")


def test_drawing_all_uniforms_at_once_equals_one_draw_per_step():
    """Static decoding draws each row's uniforms for every step up front; they must be the draws the eager
    loop takes one step at a time, or sampled tokens would depend on the decode mode."""
    gens = sequence_generators(11, [0, 5, 9])
    ahead = draw_uniforms(gens, 37)
    again = sequence_generators(11, [0, 5, 9])
    one_by_one = torch.tensor([[torch.rand((), generator=g, dtype=torch.float64).item() for _ in range(37)]
                               for g in again], dtype=torch.float64)
    assert torch.equal(ahead, one_by_one)


def test_min_new_tokens_setting_reaches_generation_capped_at_gen_len():
    """TrainConfig.min_new_tokens (fixed-length responses, gpu_check's workload) becomes the generation's
    min_new_tokens, never more than the experiment's gen_len; a negative value is refused by name."""
    import types

    from realloc.algorithms.common import generation_config
    from realloc.algorithms.critic_free.grpo import GRPOConfig

    def ctx(cfg, gen_len):
        return types.SimpleNamespace(config=cfg, gen_len=gen_len, greedy=False, seed=1, purpose="gen", iteration=0,
                                     eos_token_ids=(2,), pad_token_id=0, vocab_limit=None)

    assert generation_config(ctx(GRPOConfig(min_new_tokens=16), 32)).min_new_tokens == 16
    assert generation_config(ctx(GRPOConfig(min_new_tokens=64), 32)).min_new_tokens == 32
    assert generation_config(ctx(GRPOConfig(), 32)).min_new_tokens == 0
    with pytest.raises(ValueError, match="GRPOConfig.min_new_tokens must be a non-negative integer"):
        GRPOConfig(min_new_tokens=-1)
