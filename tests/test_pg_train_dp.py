"""DAPO's train step on real gloo ranks: dynamic sampling that leaves one dp rank with nothing to train.

Four groups of two responses over dp 2: rank 0 holds groups 0 and 1 (their rewards differ), rank 1 groups 2 and 3
(all equal: dropped). Rank 1 has no sequence in either mini-batch, yet must take part in both optimizer steps
(it trains on a padding row of weight 0). The weights after the step must be those of one device training on the
whole batch, and those of one device training on the two kept groups alone with dynamic sampling off: the
dropped groups change nothing.
"""

from __future__ import annotations

import pytest
import torch

from mp_pool import GlooPool
from model_helpers import build_model, local_shards

P, T = 4, 4
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 64, (8, P + T), generator=g)
    lens = torch.tensor([4, 3, 4, 2, 4, 4, 1, 3])
    return {"tokens": tokens, "prompt_lens": torch.full((8,), P), "gen_mask": torch.arange(T).view(1, T) < lens.view(-1, 1)}


def _train(ctx, dp: int, rows: list[int], dynamic_sampling: bool, steps: tuple[list[float], ...] = (SCORES,)):
    """DAPO train steps (one per reward list of ``steps``, iterations 0, 1, ...) on one batch; the last step's
    shards and stats, and the shards after each step under "history"."""
    from realloc.algorithms.common import forward_batch, response_columns
    from realloc.algorithms.context import CallContext
    from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig
    from realloc.algorithms.critic_free.pg_steps import dapo_train
    from realloc.calls import TRAIN_STEP, ModelFunctionCallDef
    from realloc.models.config import get_model_config

    model = build_model(ctx, get_model_config("tiny"), dp, 1, 1, seed=5, device_ids=tuple(range(dp)))
    if model is None:
        return None
    full = _batch()
    n = len(rows) // dp
    mine = rows[model.groups.dp_rank * n:(model.groups.dp_rank + 1) * n]
    seq = {k: v[mine] for k, v in full.items()}
    with torch.no_grad():
        old = response_columns(model.forward(forward_batch(seq), n_mbs=1, output="logprobs").cpu(), seq["prompt_lens"],
                               seq["gen_mask"])
    cfg = DAPOConfig(n_minibatches=2, lr=1e-2, train_prompts=2 if dynamic_sampling else None,
                     dynamic_sampling=dynamic_sampling)
    call = ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP, n_minibatches=2)
    lo = model.groups.dp_rank * n
    opt = model.make_optimizer(cfg.lr, eps=cfg.adam_eps)
    history = []
    for it, scores in enumerate(steps):
        cctx = CallContext(call=call, model=model, optimizer=opt, config=cfg, prompt_len=P, gen_len=T, seed=0,
                           iteration=it, ids=range(lo, lo + n), batch_size=len(rows), n_mbs=1,
                           total_iterations=len(steps), group_size=2)
        inputs = {"seq": seq, "logp": {"logp": old}, "ref_logp": {"logp": old},
                  "rewards": {"score": torch.tensor([scores[r] for r in mine])}}
        out = dapo_train(cctx, inputs)
        history.append(local_shards(model)["shards"])
    return {**local_shards(model), "sums": out.sums, "globals": out.globals, "history": history}


def test_dropped_groups_change_nothing_even_when_a_rank_keeps_none(pool):
    dp2 = pool.run(_train, 2, list(range(8)), True)
    whole = pool.run(_train, 1, list(range(8)), True)[0]
    kept = pool.run(_train, 1, [0, 1, 2, 3], False)[0]
    assert dp2[0]["globals"]["groups_kept"] == 2 and dp2[0]["globals"]["groups_trained"] == 2
    assert whole["globals"]["groups_kept"] == 2
    for name, w in whole["shards"].items():
        for other in (dp2[0]["shards"][name], dp2[1]["shards"][name], kept["shards"][name]):
            torch.testing.assert_close(other, w, rtol=1e-5, atol=1e-6)
    # Not a vacuous comparison: the weights moved from their start (one device, no training).
    start = pool.run(_start, 1)[0]
    moved = max(float((whole["shards"][n] - start[n]).abs().max()) for n in start)
    assert moved > 1e-3
    # The loss of the two ranks adds up to the single device's.
    loss = dp2[0]["sums"]["actor_loss"] + dp2[1]["sums"]["actor_loss"]
    assert loss == pytest.approx(whole["sums"]["actor_loss"], rel=1e-4, abs=1e-7)
    assert dp2[1]["sums"]["adv_abs_mean"] == 0.0 and dp2[0]["sums"]["adv_abs_mean"] > 0.5


def _start(ctx, dp: int):
    from realloc.models.config import get_model_config

    model = build_model(ctx, get_model_config("tiny"), dp, 1, 1, seed=5, device_ids=tuple(range(dp)))
    return None if model is None else local_shards(model)["shards"]


def test_a_batch_of_all_equal_groups_takes_no_step(pool):
    """A first step that trains, then a batch whose groups all scored alike: nothing is trained in the second, and
    its optimizer steps leave the weights as the first left them (an Adam step on a zero gradient would still move
    them by the first step's momentum)."""
    res = pool.run(_train, 2, list(range(8)), True, (SCORES, [1.0] * 8))
    assert res[0]["globals"]["groups_trained"] == 0
    for r, start in zip(res, pool.run(_start, 2)):
        first, second = r["history"]
        assert any(not torch.equal(first[n], w) for n, w in start.items())  # the first step moved them
        for name, w in first.items():
            assert torch.equal(second[name], w), name
