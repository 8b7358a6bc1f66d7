"""fp16 training with dynamic loss scaling (realloc/models/loss_scale.py; V100 pools, docs/heterogeneous.md):
small gradients survive the fp16 backward, an overflow skips the step and halves the scale."""

from __future__ import annotations

import pytest
import torch
from mp_pool import GlooPool
from test_param_realloc import _batch

from realloc.models.loss_scale import DynamicLossScale


def test_the_scale_halves_on_overflow_and_doubles_after_a_run_of_good_steps():
    s = DynamicLossScale(scale=8.0, growth_interval=3, min_scale=2.0)
    for finite, want in [(True, 8), (True, 8), (True, 16), (False, 8), (False, 4), (False, 2), (False, 2),
                         (True, 2), (True, 2), (True, 4)]:
        s.update(finite)
        assert s.scale == want


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("fp16")) as p:
        yield p


def _two_steps(ctx, factor: float, scale: float | None):
    """Two AdamW steps of the tiny model in fp32 and in fp16 (``scale``: a fixed loss scale instead of the
    dynamic one); the fp16 model's update (its fp32 masters) relative to the fp32 model's, and its stats."""
    from realloc.cluster import ClusterSpec
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.strategy import ParallelStrategy

    cfg = get_model_config("tiny")
    lay = ModelLayout.for_model(cfg, ClusterSpec.from_nodelist("n1", 2).mesh("n1:0"), ParallelStrategy(1, 1, 1))
    ctx.groups.ensure_layouts([lay])  # collective over both ranks; rank 0 alone trains
    if ctx.rank != 0:
        return None

    def loss(out, mb):  # ``factor`` shrinks every gradient (1e-6: below fp16's smallest numbers)
        m = out.token_mask
        return -(out.logprobs() * m).sum() / m.sum() * factor, {}

    update, stats = {}, None
    for dtype in (torch.float32, torch.float16):
        model = ParallelModel(cfg, ctx.groups.model_groups(lay), dtype=dtype, seed=5)
        before = {n: p.detach().float().clone() for n, p in model.params().items()}
        opt = model.make_optimizer(lr=1e-3)
        if dtype == torch.float16 and scale is not None:
            opt.loss_scale = DynamicLossScale(scale=scale, growth_interval=10**9)
        stats = [model.train_step([_batch(s, cfg.vocab_size, (0, 4))], loss, opt) for s in (1, 2)]
        after = opt.masters if dtype == torch.float16 else model.params()
        update[dtype] = {n: after[n].detach().float() - before[n] for n in before}
    ref, got = update[torch.float32], update[torch.float16]
    err = sum(float((got[n] - ref[n]).norm()) ** 2 for n in ref) ** 0.5 / sum(float(t.norm()) ** 2
                                                                             for t in ref.values()) ** 0.5
    return err, stats, opt.loss_scale


def test_fp16_training_with_loss_scaling_follows_fp32(pool):
    # gradients of ~1e-7: without scaling they flush to zero in fp16 and nothing is learned
    err, stats, scaler = pool.run(_two_steps, 1e-6, None)[0]
    assert err < 0.02 and all(s["skipped"] == 0.0 for s in stats) and scaler.scale == 2.0**16
    err_unscaled, stats, _ = pool.run(_two_steps, 1e-6, 1.0)[0]
    assert err_unscaled > 0.9 and stats[0]["grad_norm"] == 0.0  # the control: what the scale rescues
    # too large a scale overflows: the step is skipped (nothing changes) and the scale halves each time
    err, stats, scaler = pool.run(_two_steps, 1.0, 2.0**60)[0]
    assert err == 1.0 and [s["skipped"] for s in stats] == [1.0, 1.0] and scaler.scale == 2.0**58


def _save_and_resume(ctx, ckpt: str):
    """An fp16 model's loss scale is saved with its optimizer state and comes back on resume."""
    from pathlib import Path

    from realloc.cluster import ClusterSpec
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.runtime.persist.checkpoint import load_model_shard, save_model_shard
    from realloc.strategy import ParallelStrategy

    cfg = get_model_config("tiny")
    lay = ModelLayout.for_model(cfg, ClusterSpec.from_nodelist("n1", 2).mesh("n1:0"), ParallelStrategy(1, 1, 1))
    ctx.groups.ensure_layouts([lay])
    if ctx.rank != 0:
        return None
    model = ParallelModel(cfg, ctx.groups.model_groups(lay), dtype=torch.float16, seed=5)
    opt = model.make_optimizer(lr=1e-3)
    opt.loss_scale.scale, opt.loss_scale.good_steps = 2.0**11, 7
    Path(ckpt).mkdir()
    save_model_shard(Path(ckpt), "actor", 0, 0, "n1:0 dp1tp1pp1", model.params(), opt)
    fresh = ParallelModel(cfg, ctx.groups.model_groups(lay), dtype=torch.float16, init="empty")
    fresh_opt = fresh.make_optimizer(lr=1e-3)
    load_model_shard(Path(ckpt), "actor", 0, 0, "n1:0 dp1tp1pp1", fresh.params(), fresh_opt, verify=False)
    return fresh_opt.loss_scale


def test_the_loss_scale_resumes_from_a_checkpoint(pool, tmp_path):
    assert pool.run(_save_and_resume, str(tmp_path / "ckpt"))[0] == DynamicLossScale(scale=2.0**11, good_steps=7)
