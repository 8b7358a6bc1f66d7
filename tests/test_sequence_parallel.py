"""Sequence parallelism (``realloc/models/sequence_parallel.py``) against dense single-process references.

Every tp > 1 test in test_model_train.py and test_model_hf.py already runs with it (it is on by default);
these add token counts that tp does not divide (the padding rows), plain tp with it turned off, and the
memory it exists for: the layer inputs recomputation keeps are 1/tp per rank.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import build_model, hf_token_logprobs, tiny_hf_model
from mp_pool import GlooPool
from realloc.models.hf_io import model_config_from_hf
from test_model_train import _check_train

WORLD = 4


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gqa_sp")
    return tiny_hf_model(path, seed=0, kv_heads=2), path


def test_odd_token_counts_train_like_the_dense_model_with_and_without_sequence_parallelism(pool, gqa):
    # 3 rows of 4..13 tokens: B*T is odd in most micro-batches, so tp 2 and tp 4 pad the split tokens.
    hf, path = gqa
    for recompute in (False, True):
        _check_train(pool, hf, path, [(1, 2, 2), (1, 4, 1)], "sgd", 1, max_norm=0.5, rows=3, recompute=recompute)
    # turned off (plain tp: every rank holds all tokens), the same dense model's weights
    _check_train(pool, hf, path, [(1, 2, 2), (2, 2, 1)], "sgd", 1, max_norm=0.5, rows=3, sequence_parallel=False)


def test_critic_with_odd_token_counts_trains_like_the_dense_model(pool, tmp_path):
    # each tp rank scores its own tokens; the score's and norms' gradients are summed over tp
    hf = tiny_hf_model(tmp_path, seed=5, critic=True)
    _check_train(pool, hf, tmp_path, [(1, 2, 1), (1, 2, 2)], "sgd", 1, max_norm=None, critic=True, atol=1e-4,
                 rows=3, recompute=True)


def _logprobs(ctx, cfg, tp, pp, path, batch, sequence_parallel):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path, sequence_parallel=sequence_parallel)
    if model is None:
        return None
    return model.forward(batch, n_mbs=2, to_all_stages=True)


def test_forward_log_probs_match_hf_with_odd_token_counts(pool, gqa):
    hf, path = gqa
    cfg = model_config_from_hf(path)
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([9, 5, 7])
    ids = torch.randint(1, 128, (3, 9), generator=g)
    mask = (torch.arange(9)[None] < lens[:, None]).long()
    ids = ids * mask
    with torch.no_grad():
        want = hf_token_logprobs(hf.eval(), ids, mask)
    for tp, pp in [(2, 1), (2, 2), (4, 1)]:
        for sp in (True, False):
            for got in pool.run(_logprobs, cfg, tp, pp, str(path), {"input_ids": ids, "lengths": lens}, sp):
                if got is not None:
                    assert torch.allclose(got, want, atol=1e-5), (tp, pp, sp, (got - want).abs().max())


def _saved_layer_inputs(ctx, cfg, tp, sequence_parallel, batch, seq):
    """Bytes autograd keeps after one recomputed forward of the stage's layers (their inputs, cos and sin)."""
    from realloc.models.activations import SavedTensorMeter
    from realloc.models.sequence_parallel import TokenSplit

    model = build_model(ctx, cfg, 1, tp, 1, seed=2, sequence_parallel=sequence_parallel)
    if model is None:
        return None
    split = TokenSplit(model.groups.tp_group, batch, seq) if model.sequence_parallel else None
    shape = split.local_shape(cfg.hidden_size) if split else (batch, seq, cfg.hidden_size)
    hidden = torch.randn(shape, requires_grad=True)  # as the embedding's output, which needs a gradient
    positions = torch.arange(seq).repeat(batch, 1)
    with SavedTensorMeter(model.params().values()) as meter:
        out = model.stage.run_layers(hidden, positions, None, recompute=True, split=split)
        saved = meter.current
        out.sum().backward()
    return saved


def test_recomputation_keeps_one_tp_th_of_the_layer_inputs_per_rank(pool):
    from realloc.models.config import get_model_config

    cfg = get_model_config("tiny-gqa")
    b, s = 3, 8
    rope = 2 * b * s * cfg.head_dim * 4  # cos and sin (fp32), shared by the layers
    per_layer = {}
    for tp, sp in [(1, True), (2, False), (2, True), (4, True)]:
        saved = {r for r in pool.run(_saved_layer_inputs, cfg, tp, sp, b, s) if r is not None}
        assert len(saved) == 1, saved  # the same on every tp rank
        per_layer[tp, sp] = (saved.pop() - rope) / cfg.n_layers
    h = cfg.hidden_size
    assert per_layer[1, True] == b * s * h * 4  # the whole fp32 layer input
    assert per_layer[2, False] == per_layer[1, True]  # plain tp: every rank keeps every token
    assert per_layer[2, True] == per_layer[1, True] / 2 == 12 * h * 4
    assert per_layer[4, True] == per_layer[1, True] / 4 == 6 * h * 4
