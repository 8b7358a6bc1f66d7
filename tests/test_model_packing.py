"""Sequence packing inside the engine (``realloc/models/packing.py``): the packed layout by hand, and packed
forward/train_step against the dense HF model and against the engine's own padded path, at tp 2 and pp 2."""

from __future__ import annotations

import copy

import pytest
import torch

from realloc.models.batch import token_layout
from realloc.models.hf_io import model_config_from_hf
from realloc.models.packing import first_fit_decreasing, pack_layout, token_balanced_ranges
from realloc.strategy import even_ranges
from realloc.models.param_layout import param_specs
from model_helpers import assemble, build_model, hf_token_logprobs, local_shards, tiny_hf_model
from mp_pool import GlooPool
from test_model_train import ADAM_EPS, _dense_reference, nll_loss, value_loss

WORLD = 4
# Lengths that vary 1-8x: the longest row sets the width, most rows are short.
SKEWED = [[16, 2, 3, 9], [5, 16, 4, 2], [8, 1, 16, 7], [3, 12, 2, 2]]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _batch(lengths: list[int], seed: int, vocab: int = 128) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    lens = torch.tensor(lengths)
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    ids = torch.randint(1, vocab, (len(lengths), t), generator=g) * mask
    return {"input_ids": ids, "lengths": lens, "targets": torch.randn(len(lengths), t, generator=g)}


# -- the packed layout -----------------------------------------------------------------------------------


def test_first_fit_decreasing_by_hand():
    # capacity 9, longest first, ties by row: 9 | 5 + 4 | 4 + 3 + 1; the empty item goes nowhere
    assert first_fit_decreasing([5, 9, 3, 4, 0, 4, 1], 9) == [[1], [0, 3], [5, 2, 6]]
    with pytest.raises(ValueError, match="exceeds the capacity"):
        first_fit_decreasing([10], 9)


def test_pack_layout_places_every_token_with_restarting_positions():
    b = _batch([5, 9, 3, 0, 4], seed=0)
    lay = token_layout(b)
    plan = pack_layout(lay)
    # capacity 9, longest first: 9 | 5 + 4 | 3 (the empty row goes nowhere)
    bins = first_fit_decreasing([5, 9, 3, 0, 4], 9)
    assert bins == [[1], [0, 4], [2]]
    assert plan is not None and plan.layout.shape == (3, 9)
    ids, pos, seg = plan.layout.input_ids, plan.layout.position_ids, plan.layout.segment_ids
    for r, rows in enumerate(bins):
        at = 0
        for k, row in enumerate(rows):
            n = int(b["lengths"][row])
            assert torch.equal(ids[r, at:at + n], b["input_ids"][row, :n])
            assert torch.equal(pos[r, at:at + n], torch.arange(n))
            assert (seg[r, at:at + n] == k).all()
            at += n
        assert (seg[r, at:] == -1).all() and (ids[r, at:] == 0).all()
    # unpack is the inverse on real tokens and zero on padding (row 3 has none)
    back = plan.unpack(ids.float() + 1)
    assert torch.equal(back, (b["input_ids"].float() + 1) * (lay.segment_ids >= 0))
    # next-token scoring never crosses a sequence boundary inside a packed row
    assert int(plan.layout.next_token_valid().sum()) == sum(max(n - 1, 0) for n in [5, 9, 3, 0, 4])


def test_pack_layout_leaves_unpadded_and_other_layouts_alone():
    assert pack_layout(token_layout({"input_ids": torch.ones(3, 7, dtype=torch.long),
                                     "lengths": torch.tensor([7, 7, 7])})) is None
    # 6 and 2 do not share a row of capacity 6, but the rows shrink from width 8 to 6: one sequence a row, causal
    lay = token_layout({"input_ids": torch.ones(2, 8, dtype=torch.long), "lengths": torch.tensor([6, 2])})
    plan = pack_layout(lay)
    assert plan is not None and plan.layout.shape == (2, 6) and plan.layout.causal_suffices
    left = token_layout({"input_ids": torch.ones(2, 4, dtype=torch.long),
                         "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])})
    assert pack_layout(left) is None  # left padding: the caller's layout is kept
    packed = token_layout({"input_ids": torch.ones(1, 6, dtype=torch.long), "cu_seqlens": torch.tensor([0, 2, 6])})
    assert pack_layout(packed) is None


def test_skewed_micro_batches_pack_into_fewer_rows():
    for i, lens in enumerate(SKEWED):
        plan = pack_layout(token_layout(_batch(lens, i)))
        assert plan is not None and plan.layout.shape[0] < len(lens), lens


def test_token_balanced_ranges_by_hand():
    # 57 tokens in 4: cuts nearest to 14.25, 28.5, 42.75 on the running sums 16, 18, 21, 30, 35, 51, 55, 57
    assert token_balanced_ranges([16, 2, 3, 9, 5, 16, 4, 2], 4) == [(0, 1), (1, 4), (4, 5), (5, 8)]
    assert token_balanced_ranges([1, 1, 1, 100], 2) == [(0, 3), (3, 4)]
    assert token_balanced_ranges([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]  # every micro-batch keeps a row
    for b, n in [(5, 2), (7, 3), (4, 4)]:
        assert token_balanced_ranges([6] * b, n) == list(even_ranges(b, n))  # equal lengths: the row split
    with pytest.raises(ValueError, match="n_mbs=3"):
        token_balanced_ranges([1, 2], 3)


# -- forward ---------------------------------------------------------------------------------------------


def _forward(ctx, cfg, tp, pp, path, batch, n_mbs, outputs):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path)
    if model is None:
        return None
    res = {}
    for pack in (True, False):
        model.pack_sequences = pack
        data = {"input_ids": batch["input_ids"], "lengths": batch["lengths"]}
        res[pack] = {o: model.forward(data, n_mbs=n_mbs, output=o, to_all_stages=True) for o in outputs}
    # Packing and sequence parallelism compose: the engine packs into [R, C] rows, then splits the R * C
    # flattened tokens over tp, and a pipeline stage sends the rank's share of them.
    model.pack_sequences = True
    plan = pack_layout(token_layout(data, "test"))
    res["split"] = (model.sequence_parallel, plan.layout.shape, model._hidden_shape(plan.layout))
    return res


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_pack_actor")
    return tiny_hf_model(path, seed=0, kv_heads=2), path


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_pack_critic")
    return tiny_hf_model(path, seed=5, critic=True), path


def _all_rows() -> dict[str, torch.Tensor]:
    lens = [n for mb in SKEWED for n in mb]
    return _batch(lens, seed=3)


def test_packed_forward_matches_the_dense_model_and_the_padded_path(pool, actor):
    hf, path = actor
    cfg = model_config_from_hf(path)
    batch = _all_rows()
    ids, lens = batch["input_ids"], batch["lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    with torch.no_grad():
        ref = hf_token_logprobs(hf, ids, mask)
        logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        lp_all = torch.log_softmax(logits[:, :-1], -1)
        ref_ent = torch.zeros(ids.shape)
        ref_ent[:, 1:] = -(lp_all.exp() * lp_all).sum(-1) * (mask[:, 1:].bool() & mask[:, :-1].bool())
    for tp, pp, n_mbs in [(2, 2, 4), (1, 1, 2), (2, 1, 1)]:
        res = pool.run(_forward, cfg, tp, pp, str(path), batch, n_mbs, ("logprobs", "entropy", "logits"))
        for r in res:
            if r is None:
                continue
            packed, padded = r[True], r[False]
            assert (packed["logprobs"] - ref).abs().max() < 1e-5, (tp, pp)
            assert (packed["entropy"] - ref_ent).abs().max() < 1e-4, (tp, pp)
            assert (packed["logits"] - logits * mask[..., None]).abs().max() < 1e-4, (tp, pp)
            for o in packed:
                assert (packed[o] - padded[o]).abs().max() < 1e-5, (tp, pp, o)
            assert (packed["logprobs"][:, 0] == 0).all() and (packed["logprobs"] * (1 - mask) == 0).all()
            sp, (rows, cols), sent = r["split"]
            assert rows * cols < ids.numel() and sp == (tp > 1), (tp, rows, cols)  # packed, split at tp 2
            assert sent == ((-(-rows * cols // tp), cfg.hidden_size) if tp > 1 else (rows, cols, cfg.hidden_size))


def test_packed_critic_forward_matches_the_dense_model(pool, critic):
    hf, path = critic
    cfg = model_config_from_hf(path)
    batch = _all_rows()
    ids, lens = batch["input_ids"], batch["lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    with torch.no_grad():
        ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    res = pool.run(_forward, cfg, 2, 2, str(path), batch, 2, ("values",))
    for r in res:
        if r is not None:
            assert (r[True]["values"] - ref).abs().max() < 1e-4
            assert (r[True]["values"] - r[False]["values"]).abs().max() < 1e-5


# -- training --------------------------------------------------------------------------------------------


def _train(ctx, cfg, dp, tp, pp, path, mbs, kind, pack, recompute):
    model = build_model(ctx, cfg, dp, tp, pp, hf_path=path)
    if model is None:
        return None
    model.pack_sequences = pack
    g = model.groups
    opt = model.make_optimizer(lr=1e-2, weight_decay=0.1, eps=ADAM_EPS) if kind == "adamw" else \
        torch.optim.SGD(list(model.params().values()), lr=1.0)
    per = len(mbs) // dp
    mine = mbs[g.dp_rank * per:(g.dp_rank + 1) * per]
    loss_fn = value_loss if cfg.is_critic else nll_loss
    stats = [model.train_step(mine, loss_fn, opt, max_grad_norm=0.5, recompute=recompute) for _ in range(2)]
    return {**local_shards(model), "stats": stats}


def _check_packed_training(pool, hf, path, layouts, kind, *, critic=False, atol=2e-5, recompute=False):
    cfg = model_config_from_hf(path)
    specs = {s.name: s for s in param_specs(cfg)}
    mbs = [_batch(lens, seed=20 + i, vocab=min(cfg.vocab_size, 128)) for i, lens in enumerate(SKEWED)]
    ref_state, ref_hist = _dense_reference(copy.deepcopy(hf), mbs, kind, 2, 0.5, critic)
    for dp, tp, pp in layouts:
        runs = {pack: [r for r in pool.run(_train, cfg, dp, tp, pp, str(path), mbs, kind, pack, recompute)
                       if r is not None] for pack in (True, False)}
        for r, plain in zip(runs[True], runs[False]):
            for s, sp, ref in zip(r["stats"], plain["stats"], ref_hist):
                assert abs(s["grad_norm"] - ref["grad_norm"]) < 1e-4 * max(1.0, ref["grad_norm"]), (dp, tp, pp, s)
                assert abs(s["grad_norm"] - sp["grad_norm"]) < 1e-5 * max(1.0, sp["grad_norm"]), (dp, tp, pp, s, sp)
                if r["pp"] == pp - 1:
                    assert abs(s["loss"] - ref["loss"]) < 1e-5, (dp, tp, pp, s, ref)
            for name, t in r["shards"].items():
                assert (t - plain["shards"][name]).abs().max() < atol, (dp, tp, pp, name)
        got = assemble([dict(r, dp=0) for r in runs[True] if r["dp"] == 0], cfg)
        for name, t in got.items():
            real = specs[name].unpad(t)
            err = (real - ref_state[name]).abs().max().item()
            assert err < atol, (dp, tp, pp, name, err)


def test_packed_training_matches_the_dense_model_and_the_padded_path(pool, actor):
    hf, path = actor
    _check_packed_training(pool, hf, path, [(1, 2, 2), (2, 1, 2)], "sgd")
    _check_packed_training(pool, hf, path, [(1, 2, 2)], "adamw", recompute=True)


def test_packed_critic_training_matches_the_dense_model(pool, critic):
    hf, path = critic
    _check_packed_training(pool, hf, path, [(1, 2, 2)], "sgd", critic=True, atol=1e-4)
