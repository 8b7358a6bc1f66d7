"""Checkpoint files: atomic commit, discovery for --resume, exact optimizer round trip."""

import pytest
import torch

from realloc.runtime import checkpoint as C


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.nn.Parameter(torch.randn(4, 3, generator=g)), "b": torch.nn.Parameter(torch.randn(3, generator=g))}
    opt = torch.optim.AdamW([{"params": [params["w"]], "weight_decay": 0.1},
                             {"params": [params["b"]], "weight_decay": 0.0}], lr=0.05)
    return params, opt


def step(params, opt, k):
    x = torch.arange(4.0) + k
    loss = ((x @ params["w"] + params["b"]) ** 2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_resumed_optimizer_continues_exactly(tmp_path):
    params, opt = make()
    for k in range(3):
        step(params, opt, k)
    tmp = C.begin(tmp_path, 2)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    C.save_rng(tmp, 0)
    final = C.commit(tmp, tmp_path, 2, {"next_iteration": 3}, "{}")
    for k in range(3, 6):
        step(params, opt, k)

    fresh, fresh_opt = make(seed=1)  # different values: everything must come from the file
    torch.manual_seed(123)
    C.load_model_shard(final, "actor", 0, 0, "L", fresh, fresh_opt)
    C.load_rng(final, 0)
    for k in range(3, 6):
        step(fresh, fresh_opt, k)
    for n in params:
        assert torch.equal(params[n], fresh[n])
    assert fresh_opt.param_groups[0]["weight_decay"] == 0.1


def test_uncommitted_checkpoints_are_invisible_and_cleaned(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    tmp = C.begin(root, 0)
    C.save_rng(tmp, 0)
    assert C.latest(root) is None  # killed before commit: nothing to resume from
    with pytest.raises(ValueError, match="no complete checkpoint"):
        C.resolve_resume(run)
    first = C.commit(tmp, root, 0, {"next_iteration": 1}, "{}")
    tmp2 = C.begin(root, 1)  # a later save that never finishes
    assert C.latest(root) == first
    assert C.resolve_resume(run) == first == C.resolve_resume(root) == C.resolve_resume(first)
    assert C.read_meta(first)["next_iteration"] == 1 and (first / "plan.json").read_text() == "{}"
    C.begin(root, 2)
    assert not tmp2.exists()  # stale temporaries are removed by the next save


def test_layout_mismatch_is_refused(tmp_path):
    params, opt = make()
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "localhost dp2·tp1·pp1", params, opt)
    final = C.commit(tmp, tmp_path, 0, {}, "{}")
    with pytest.raises(ValueError, match="saved in layout localhost dp2·tp1·pp1"):
        C.load_model_shard(final, "actor", 0, 0, "localhost:0 dp1·tp1·pp1", params, opt)
    with pytest.raises(ValueError, match="no shard"):
        C.load_model_shard(final, "actor", 1, 0, "localhost dp2·tp1·pp1", params, opt)


def test_bf16_master_weights_round_trip(tmp_path):
    from realloc.models.optim import MasterWeightAdamW

    def build(seed):
        g = torch.Generator().manual_seed(seed)
        params = {"w": torch.nn.Parameter(torch.randn(4, 3, generator=g).bfloat16())}
        return params, MasterWeightAdamW(params, lr=1e-3)

    def bf16_step(params, opt, k):
        opt.step_with({"w": torch.full((4, 3), 0.1 * (k + 1))})

    params, opt = build(0)
    for k in range(2):
        bf16_step(params, opt, k)
    tmp = C.begin(tmp_path, 0)
    C.save_model_shard(tmp, "actor", 0, 0, "L", params, opt)
    final = C.commit(tmp, tmp_path, 0, {}, "{}")
    for k in range(2, 4):
        bf16_step(params, opt, k)
    fresh, fresh_opt = build(1)
    C.load_model_shard(final, "actor", 0, 0, "L", fresh, fresh_opt)
    for k in range(2, 4):
        bf16_step(fresh, fresh_opt, k)
    assert torch.equal(params["w"], fresh["w"]) and torch.equal(opt.masters["w"], fresh_opt.masters["w"])
