"""A fused train step of two ParallelModels (issue 33 item 4; models/fused_train.py) on 4 gloo processes at
pp 2: an actor and a critic, the critic's stages in reverse order, one fused order of both models' passes
per device, then each model's gradient reductions and optimizer step. After two such steps both models'
parameters and whole optimizer states (AdamW moments, the distributed optimizer's gathered state) equal those
of each model's own ``train_step`` run one after the other, with sequence parallelism (tp 2), the distributed
optimizer (dp 2), packing (on by default) and recomputation inside, at 2 to 8 micro-batches."""

from __future__ import annotations

import pytest
import torch

from realloc import _C
from mp_pool import GlooPool
from model_helpers import build_model
from test_model_train import _micro_batches, nll_loss, value_loss

WORLD = 4
STEPS = 2


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _order(n_mbs: tuple[int, int], which: str) -> list:
    """Per stage group, an order of both models' passes from the schedule search (uniform stage times)."""
    a, b = n_mbs
    prob = _C.FusedProblem(2, 2, a, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0], 2, b, [0.8, 0.8], [1.6, 1.6], [1.0, 1.0])
    return prob.search(iterations=300, memory_iterations=100)["order"] if which == "search" else prob.greedy(primary=1)


def _optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    """Every optimizer state entry by parameter name (the distributed optimizer's gathered over dp)."""
    from realloc.models.zero import DistributedAdamW

    if isinstance(opt, DistributedAdamW):
        return {f"{n}/{k}": v for n, _, st in opt.gathered_state() for k, v in st.items()}
    names = {id(p): n for n, p in model.trained_params().items()}
    return {f"{names[id(p)]}/{k}": v.clone() for p, st in opt.state.items() for k, v in st.items()}


def _pair(ctx, layouts, n_mbs, recompute, order, fused):
    from realloc.models.config import get_model_config
    from realloc.models.fused_train import TrainArgs, fused_train_step

    cfgs = get_model_config("tiny"), get_model_config("tiny-critic")
    # the critic's stage 0 on the second stage group (ranks 2, 3), its stage 1 on the first
    ids = (0, 1, 2, 3), (2, 3, 0, 1)
    models = [build_model(ctx, cfg, *lay, seed=3 + k, device_ids=ids[k])
              for k, (cfg, lay) in enumerate(zip(cfgs, layouts))]
    opts = [m.make_optimizer(1e-2, weight_decay=0.1, eps=1e-5) for m in models]
    losses = nll_loss, value_loss
    for step in range(STEPS):
        args = [TrainArgs(_micro_batches(100 * step + 10 * k + m.groups.dp_rank, n=n_mbs[k], vocab=64), losses[k],
                          opts[k], max_grad_norm=1.0, recompute=recompute[k]) for k, m in enumerate(models)]
        if fused:
            fused_train_step(models, args, order)
        else:
            for m, a in zip(models, args):
                m.train_step(a.micro_batches, a.loss_fn, a.optimizer, max_grad_norm=a.max_grad_norm,
                             recompute=a.recompute)
    return [({n: p.detach().clone() for n, p in m.params().items()}, _optimizer_state(m, o))
            for m, o in zip(models, opts)]


def _both(ctx, layouts, n_mbs, recompute, order):
    serial = _pair(ctx, layouts, n_mbs, recompute, order, fused=False)
    fused = _pair(ctx, layouts, n_mbs, recompute, order, fused=True)
    worst = 0.0
    for (ps, ss), (pf, sf) in zip(serial, fused):
        assert ps.keys() == pf.keys() and ss.keys() == sf.keys() and ss
        for a, b in [(ps[n], pf[n]) for n in ps] + [(ss[n], sf[n]) for n in ss]:
            worst = max(worst, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return worst


# (actor dp, tp, pp), (critic dp, tp, pp), micro-batches, recompute, order
CASES = [
    (((1, 2, 2), (2, 1, 2)), (2, 4), (True, False), "search"),
    (((2, 1, 2), (1, 2, 2)), (8, 8), (False, True), "greedy"),
    (((1, 2, 2), (1, 2, 2)), (4, 3), (False, False), "search"),
    (((4, 1, 1), (2, 2, 1)), (2, 3), (False, True), "search"),  # pp 1: nothing to pipeline, same steps
]


@pytest.mark.parametrize("layouts,n_mbs,recompute,which", CASES,
                         ids=["tp2-sp+dp2-zero", "dp2-zero+tp2-sp", "tp2+tp2", "pp1"])
def test_fused_steps_leave_both_models_as_their_own_train_steps_do(pool, layouts, n_mbs, recompute, which):
    order = _order(n_mbs, which)
    for worst in pool.run(_both, layouts, n_mbs, recompute, order, timeout=240):
        assert worst <= 1e-6


def test_a_second_model_in_the_same_stage_order_is_refused(pool):
    assert all(pool.run(_same_order))


def _same_order(ctx):
    from realloc.models.config import get_model_config
    from realloc.models.fused_train import TrainArgs, fused_train_step

    models = [build_model(ctx, get_model_config(t), 2, 1, 2) for t in ("tiny", "tiny-critic")]
    args = [TrainArgs(_micro_batches(0, n=2, vocab=64), loss, m.make_optimizer(1e-2))
            for m, loss in zip(models, (nll_loss, value_loss))]
    with pytest.raises(ValueError, match="reverse order"):
        fused_train_step(models, args, [])
    return True
