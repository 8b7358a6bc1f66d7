"""Fused pipeline execution (issue 33, item 4; models/fused_pipeline.py) on 2 gloo processes at pp 2: two
models, the second in reverse stage order, run one fused order per device; after the step both models'
parameters and AdamW states equal those of the serial run (run_1f1b of one model, then of the other), and the
gradients equal a dense single-process model's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from realloc import _C
from tests.mp_pool import GlooPool

WIDTH = (8, 6)  # model 0 (A), model 1 (B)
ROWS = 3


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


class _Groups:
    """The part of ModelParallelGroups a StageLink reads: the pp group and this rank's place in it."""

    def __init__(self, pp_ranks: tuple[int, ...], rank: int) -> None:
        self.pp_group = dist.group.WORLD
        self.pp_ranks, self.pp, self.pp_rank = pp_ranks, len(pp_ranks), pp_ranks.index(rank)
        self.is_first_stage, self.is_last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.prev_stage_rank = None if self.is_first_stage else pp_ranks[self.pp_rank - 1]
        self.next_stage_rank = None if self.is_last_stage else pp_ranks[self.pp_rank + 1]


def _models() -> list[list[torch.nn.Module]]:
    torch.manual_seed(0)
    return [[torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh()) for _ in range(2)] for w in WIDTH]


def _data(model: int, n_mbs: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + model)
    return [torch.randn(ROWS, WIDTH[model], generator=g) for _ in range(n_mbs)]


def _step_fn(stage_mod, model, stage, data, recompute):
    def step(mb, x):
        inp = data[mb] if stage == 0 else x
        out = checkpoint(stage_mod, inp, use_reentrant=False) if recompute else stage_mod(inp)
        return (out ** 2).mean() * (mb + 1) if stage == 1 else out  # the last stage returns the loss
    return step


def _case(ctx, n_mbs, recompute, order):
    from realloc.models.fused_pipeline import FusedPart, run_fused
    from realloc.models.pipeline import StageLink, run_1f1b

    full = _models()
    # model 0 runs up the ranks (stage = rank), model 1 down them (stage = 1 - rank)
    stage_of = [ctx.rank, 1 - ctx.rank]
    ranks = [(0, 1), (1, 0)]
    data = [_data(m, n_mbs[m]) for m in (0, 1)]

    def parts(mods):
        out = []
        for m in (0, 1):
            link = StageLink(_Groups(ranks[m], ctx.rank), torch.device("cpu"), torch.float32, tag_offset=100 * m)
            out.append((link, n_mbs[m], _step_fn(mods[m], m, stage_of[m], data[m], recompute),
                        lambda i, w=WIDTH[m]: (ROWS, w)))
        return out

    def train(mods, fused):
        opts = [torch.optim.AdamW(mods[m].parameters(), lr=1e-2) for m in (0, 1)]
        ps = parts(mods)
        if fused:
            run_fused(order, [FusedPart(*p) for p in ps])
        else:
            for p in ps:
                run_1f1b(p[0], p[1], p[2], p[3])
        grads = [[q.grad.clone() for q in mods[m].parameters()] for m in (0, 1)]
        for o in opts:
            o.step()
        return grads, opts

    mine = [full[m][stage_of[m]] for m in (0, 1)]
    serial_mods, fused_mods = copy.deepcopy(mine), copy.deepcopy(mine)
    _, serial_opts = train(serial_mods, fused=False)
    fused_grads, fused_opts = train(fused_mods, fused=True)
    # dense reference: the whole model in this process, micro-batches in order
    dense = []
    for m in (0, 1):
        net = torch.nn.Sequential(*copy.deepcopy(full[m]))
        for mb, x in enumerate(data[m]):
            ((net(x) ** 2).mean() * (mb + 1)).backward()
        dense.append([q.grad for q in net[stage_of[m]].parameters()])
    same_params = all(torch.equal(a, b) for m in (0, 1)
                      for a, b in zip(serial_mods[m].parameters(), fused_mods[m].parameters()))
    same_states = all(torch.equal(serial_opts[m].state[a][k], fused_opts[m].state[b][k])
                      for m in (0, 1) for a, b in zip(serial_mods[m].parameters(), fused_mods[m].parameters())
                      for k in ("exp_avg", "exp_avg_sq", "step"))
    dense_err = max((a - b).abs().max().item() for m in (0, 1) for a, b in zip(fused_grads[m], dense[m]))
    return same_params, same_states, dense_err


@pytest.mark.parametrize("n_mbs,recompute", [((2, 2), False), ((4, 2), True), ((8, 4), False), ((3, 8), True)])
def test_fused_step_equals_serial_step(pool, n_mbs, recompute):
    ma, mb = n_mbs
    prob = _C.FusedProblem(2, 2, ma, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0], 2, mb, [0.7, 0.7], [1.4, 1.4], [1.0, 1.0])
    orders = [prob.search(iterations=500, memory_iterations=200)["order"], prob.greedy(), prob.greedy(primary=1)]
    for order in orders:
        for same_params, same_states, dense_err in pool.run(_case_on_rank, n_mbs, recompute, order, timeout=120):
            assert same_params and same_states
            assert dense_err < 1e-5


def _case_on_rank(ctx, n_mbs, recompute, order):
    return _case(ctx, n_mbs, recompute, [[tuple(p) for p in stage] for stage in order])


def test_an_order_that_breaks_micro_batch_order_is_refused():
    from realloc.models.fused_pipeline import FusedPart, check_order

    parts = [FusedPart(None, 2, None, None), FusedPart(None, 1, None, None)]
    check_order([(0, 0, 0), (1, 0, 0), (0, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1)], parts)
    with pytest.raises(ValueError, match="out of place"):
        check_order([(0, 0, 1), (0, 0, 0), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 1, 0)], parts)
    with pytest.raises(ValueError, match="missing passes"):
        check_order([(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)], parts)
