"""The train-step API's bookkeeping, on a stand-in engine that records what it is handed (the real engine runs in
tests/test_custom_algorithm.py): which rows each optimizer step gets, the loss weights, the stats, the schedule,
and one clear error for a loss function that breaks the contract."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from realloc.algorithms.context import CallContext
from realloc.algorithms.train_config import TrainConfig
from realloc.algorithms.train_step import MiniBatch, Rollout, TrainStep
from realloc.api import TRAIN_STEP, ModelFunctionCallDef

T = 4


@dataclasses.dataclass(frozen=True)
class Cfg(TrainConfig):
    pass


class Engine:
    """ParallelModel's train_step interface: calls the loss on each micro-batch with a head whose log-probs are
    a learnable [B, L] tensor, and keeps what it saw."""

    def __init__(self) -> None:
        self.groups = types.SimpleNamespace(dp=1, is_last_stage=True)
        self.steps: list[dict] = []

    def train_step(self, micro, loss_fn, optimizer, max_grad_norm, loss_weights, recompute):
        seen = {"lr": optimizer.param_groups[0]["lr"], "losses": [], "clip": max_grad_norm}
        for mb in micro:
            raw = torch.zeros(mb["input_ids"].shape, requires_grad=True)
            head = types.SimpleNamespace(raw=raw, logprobs=lambda t=1.0, raw=raw: raw - 1.0)
            loss, _ = loss_fn(head, mb)
            seen["losses"].append(float(loss.detach()))
        self.steps.append(seen)
        return {"grad_norm": 1.5}


def _ctx(engine, n: int, M: int, cfg: Cfg, iteration: int = 0, lo: int = 0) -> CallContext:
    call = ModelFunctionCallDef(name="train", model_name="policy", interface_type=TRAIN_STEP, interface_impl="x",
                                input_data=["seq", "rewards"], n_minibatches=M)
    opt = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
    return CallContext(call=call, model=engine, optimizer=opt, config=cfg, prompt_len=2, gen_len=T, seed=0,
                       iteration=iteration, ids=range(lo, lo + n), batch_size=n, n_mbs=1, total_iterations=3,
                       lr_field="lr")


def _inputs(lengths: list[int]) -> dict:
    n = len(lengths)
    mask = torch.arange(T).view(1, T) < torch.tensor(lengths).view(-1, 1)
    return {"seq": {"tokens": torch.arange(n * (2 + T)).view(n, 2 + T) % 7 + 1, "prompt_lens": torch.full((n,), 2),
                    "gen_mask": mask},
            "rewards": {"score": torch.arange(n, dtype=torch.float32)}}


LENGTHS = [1, 4, 2, 3, 4, 1]


def test_minibatches_weights_stats_and_schedule():
    rows_seen: list[list[float]] = []

    def prepare(ro: Rollout):
        return {"double": ro["rewards"]["score"] * 2}

    def loss(mb: MiniBatch):
        rows_seen.append(mb["rewards"]["score"].tolist())
        assert torch.equal(mb.extra["double"], mb["rewards"]["score"] * 2)
        pos = torch.arange(T, dtype=torch.float32).expand(mb.mask.shape)
        return mb.logprobs() * 0 + pos, {"pos": pos, "score": mb["rewards"]["score"]}

    engine = Engine()
    cfg = Cfg(n_minibatches=2, lr=1e-2, lr_schedule="cosine")
    out = TrainStep(loss, stats=("pos", "score"), prepare=prepare, loss_norm="token")(
        _ctx(engine, 6, 2, cfg, iteration=1), _inputs(LENGTHS))
    # mini-batch k = sequences with global index k mod 2
    assert rows_seen == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    # token normalization: a mini-batch's loss is its mean response-token position, by hand
    masks = [[LENGTHS[i] for i in (0, 2, 4)], [LENGTHS[i] for i in (1, 3, 5)]]
    means = [sum(sum(range(n)) for n in m) / sum(m) for m in masks]
    assert [s["losses"][0] for s in engine.steps] == pytest.approx(means)
    # steps 2 and 3 of 6 of a cosine schedule from 1e-2 to 0
    lrs = [1e-2 * 0.5 * (1 + math.cos(math.pi * s / 5)) for s in (2, 3)]
    assert [s["lr"] for s in engine.steps] == pytest.approx(lrs) and engine.steps[0]["clip"] == 1.0
    assert out.sums["policy_loss"] == pytest.approx(sum(means) / 2)
    assert out.sums["policy_pos"] == pytest.approx(sum(means) / 2)  # per-token stat: the token mean
    assert out.sums["policy_score"] == pytest.approx((2.0 + 3.0) / 2)  # per-sequence stat: mean over sequences
    assert out.globals == {"policy_grad_norm": 1.5, "policy_lr": pytest.approx(lrs[0])}


@pytest.mark.parametrize("norm, want", [
    # per response: mean over its tokens, then over the mini-batch's responses
    ("sequence", lambda ls: sum(sum(range(n)) / n for n in ls) / len(ls)),
    # sum over each response's tokens / gen_len, mean over responses
    ("constant", lambda ls: sum(sum(range(n)) for n in ls) / (T * len(ls))),
])
def test_loss_norms(norm, want):
    engine = Engine()
    step = TrainStep(lambda mb: (mb.logprobs() * 0 + torch.arange(T, dtype=torch.float32), {}), loss_norm=norm)
    step(_ctx(engine, 6, 1, Cfg()), _inputs(LENGTHS))
    assert engine.steps[0]["losses"][0] == pytest.approx(want(LENGTHS))


def test_per_sequence_loss_is_averaged_over_sequences():
    engine = Engine()
    step = TrainStep(lambda mb: (mb.logprobs().sum(dim=1) * 0 + mb["rewards"]["score"], {}))
    step(_ctx(engine, 6, 1, Cfg()), _inputs(LENGTHS))
    assert engine.steps[0]["losses"][0] == pytest.approx(sum(range(6)) / 6)


@pytest.mark.parametrize("loss, stats, words", [
    (lambda mb: (mb.logprobs(), {"other": mb.mask.float()}), ("pos",),
     ["call 'train'", "reported stats ['other']", "declares ['pos']"]),
    (lambda mb: (mb.logprobs().sum(), {}), (), ["call 'train'", "loss has shape ()", "one loss per response token"]),
    (lambda mb: (mb.logprobs(), {"pos": torch.tensor(1.0)}), ("pos",), ["stat 'pos' is a tensor of shape ()"]),
    (lambda mb: mb.logprobs(), (), ["must return (loss tensor, {stat: tensor})"]),
])
def test_a_loss_function_that_breaks_the_contract_gets_one_clear_error(loss, stats, words):
    with pytest.raises(ValueError) as e:
        TrainStep(loss, stats=stats)(_ctx(Engine(), 6, 1, Cfg()), _inputs(LENGTHS))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="stats must be a tuple of identifiers"):
        TrainStep(lambda mb: None, stats="clip_frac")
    with pytest.raises(ValueError, match="stats \\['loss'\\] would collide"):
        TrainStep(lambda mb: None, stats=("loss", "kl"))
    with pytest.raises(ValueError, match="loss_norm must be one of"):
        TrainStep(lambda mb: None, loss_norm="mean")
    with pytest.raises(ValueError, match="prepare must return per-sequence tensors.*'adv' is a tensor of shape \\(2,\\)"):
        TrainStep(lambda mb: None, prepare=lambda ro: {"adv": torch.zeros(2)})(_ctx(Engine(), 6, 1, Cfg()),
                                                                             _inputs(LENGTHS))


def test_whiten_uses_the_batch_mean_and_std_over_response_tokens():
    ro = Rollout(_ctx(Engine(), 6, 1, Cfg()), _inputs(LENGTHS))
    x = torch.arange(6 * T, dtype=torch.float32).view(6, T)
    vals = torch.cat([x[i, :n] for i, n in enumerate(LENGTHS)]).double()
    mean, std = vals.mean(), vals.std(unbiased=False)
    got = ro.whiten(x)
    for i, n in enumerate(LENGTHS):
        assert got[i, :n].tolist() == pytest.approx(((x[i, :n] - mean) / (std + 1e-8)).tolist(), rel=1e-6)
        assert (got[i, n:] == 0).all()


def _raw_step(ctx, set_own: list[float] | None):
    """A train step on common.optimizer_step directly, optionally setting its own lr before each step."""
    from realloc.algorithms.common import optimizer_step

    seq = _inputs(LENGTHS)["seq"]
    mb = {"input_ids": seq["tokens"], "lengths": seq["prompt_lens"] + seq["gen_mask"].sum(dim=1)}
    for k in range(ctx.call.n_minibatches):
        if set_own is not None:
            ctx.optimizer.param_groups[0]["lr"] = set_own[k]
        optimizer_step(ctx, [mb], lambda head, m: (head.logprobs().sum() * 0, {}))


@pytest.mark.parametrize("own", [None, [5e-3, 7e-3, 5e-3]])
def test_a_raw_train_step_gets_the_schedule_unless_it_sets_its_own(own):
    from realloc.algorithms.common import set_step_lr

    engine = Engine()
    ctx = _ctx(engine, 6, 3, Cfg(n_minibatches=3, lr=1e-2, lr_schedule="linear", min_lr_ratio=0.1))
    set_step_lr(ctx, 0)  # what the worker does before any train step
    _raw_step(ctx, own)
    # linear from 1e-2 to 1e-3 over 9 steps (3 iterations x 3): steps 0, 1, 2
    want = own or [1e-2 - (1e-2 - 1e-3) * s / 8 for s in range(3)]
    assert [s["lr"] for s in engine.steps] == pytest.approx(want)


def test_padding_positions_count_for_nothing_even_when_not_finite():
    engine = Engine()

    def loss(mb: MiniBatch):
        per = torch.where(mb.mask, mb.logprobs() * 0 + 2.0, torch.full(mb.mask.shape, float("nan")))
        return per, {"junk": torch.where(mb.mask, per, torch.full(mb.mask.shape, float("inf")))}

    out = TrainStep(loss, stats=("junk",))(_ctx(engine, 6, 1, Cfg()), _inputs(LENGTHS))
    assert engine.steps[0]["losses"][0] == pytest.approx(2.0) and out.sums["policy_junk"] == pytest.approx(2.0)
