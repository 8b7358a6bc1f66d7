"""LoRA on the tensor-parallel model (``realloc/models/lora.py``) against a dense single-process reference.

The reference is the HF model in the test process with ``h = W0 x + (alpha / r) B A x`` added by forward hooks
on its ``nn.Linear`` projections (Hu et al. 2021, eq. 3), written here from the formula. With SGD at lr 1 the
adapters after one step are ``A - dA`` and ``B - dB``: every layout's adapters must equal the dense model's, and
the frozen base must not move.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from model_helpers import build_model, hf_token_logprobs, local_shards, tiny_hf_model
from mp_pool import GlooPool
from realloc.models.hf_io import model_config_from_hf
from realloc.models.lora_config import LoRAConfig, is_adapter
from realloc.models.param_layout import param_specs

WORLD = 4
LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_lora")
    return tiny_hf_model(path, seed=0, kv_heads=2), path


def _micro_batches(seed: int, n: int = 4, rows: int = 2, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens = torch.randint(4, 14, (rows,), generator=g)
        t = int(lens.max())
        ids = torch.randint(1, vocab, (rows, t), generator=g)
        mask = (torch.arange(t)[None] < lens[:, None]).long()
        out.append({"input_ids": ids * mask, "lengths": lens})
    return out


def _adapters(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Full adapter tensors with B non-zero (a trained state), so both factors' gradients are exercised."""
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) * 0.1 for s in param_specs(cfg) if is_adapter(s.name)}


def nll_loss(out, mb):
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / mask.sum(), {}


class DenseLoRA:
    """The HF model with LoRA adapters as hooks: the formula, independent of realloc's modules."""

    def __init__(self, hf, lora: LoRAConfig, adapters: dict[str, torch.Tensor]) -> None:
        self.hf = copy.deepcopy(hf).train()
        for p in self.hf.parameters():
            p.requires_grad_(False)
        self.params = {n: torch.nn.Parameter(t.clone()) for n, t in adapters.items()}
        self.enabled = True
        s = lora.alpha / lora.rank
        for name, mod in self.hf.named_modules():
            if name.split(".")[-1] in lora.target_modules:
                a, b = self.params[name + ".lora_A.weight"], self.params[name + ".lora_B.weight"]
                mod.register_forward_hook(lambda m, args, out, a=a, b=b: out + s * (args[0] @ a.T) @ b.T
                                          if self.enabled else out)

    def logprobs(self, ids, lens):
        mask = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
        return hf_token_logprobs(self.hf, ids, mask), mask

    def sgd_step(self, mbs, max_norm):
        for p in self.params.values():
            p.grad = None
        for mb in mbs:
            lp, mask = self.logprobs(mb["input_ids"], mb["lengths"])
            tok = torch.zeros_like(mask, dtype=torch.bool)
            tok[:, 1:] = mask[:, 1:].bool() & mask[:, :-1].bool()
            (-(lp * tok).sum() / tok.sum() / len(mbs)).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), max_norm))
        with torch.no_grad():
            for p in self.params.values():
                p -= p.grad
        return norm


def _set_adapters(model, full):
    g = model.groups
    with torch.no_grad():
        for name, p in model.params().items():
            if is_adapter(name):
                p.copy_(full[name][model.specs[name].shard_slices(g.tp, g.tp_rank)])


def _train(ctx, cfg, dp, tp, pp, path, adapters, mbs, max_norm, recompute, sequence_parallel):
    model = build_model(ctx, cfg, dp, tp, pp, hf_path=path, sequence_parallel=sequence_parallel)
    if model is None:
        return None
    _set_adapters(model, adapters)
    before = {n: p.detach().clone() for n, p in model.params().items()}
    opt = torch.optim.SGD(list(model.trained_params().values()), lr=1.0)
    per = len(mbs) // dp
    mine = mbs[model.groups.dp_rank * per:(model.groups.dp_rank + 1) * per]
    stats = model.train_step(mine, nll_loss, opt, max_grad_norm=max_norm, recompute=recompute)
    frozen_moved = [n for n, p in model.params().items() if not is_adapter(n) and not torch.equal(p, before[n])]
    return {**local_shards(model), "stats": stats, "frozen_moved": frozen_moved,
            "trained": sorted(model.trained_params())}


def _assemble_adapters(results, cfg):
    specs = {s.name: s for s in param_specs(cfg)}
    full = {n: torch.full(s.shape, float("nan")) for n, s in specs.items() if is_adapter(n)}
    for r in results:
        if r is None or r["dp"] != 0:
            continue
        for name, shard in r["shards"].items():
            if is_adapter(name):
                full[name][specs[name].shard_slices(r["tp_size"], r["tp"])] = shard
    assert not any(torch.isnan(t).any() for t in full.values())
    return full


def test_adapter_specs_split_like_their_base_layer():
    cfg = dataclasses.replace(model_config_from_hf_dict(), lora=LORA)
    specs = {s.name: s for s in param_specs(cfg)}
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    k = "model.layers.0.self_attn.k_proj"
    # column-parallel: A whole, B split on the output rows; row-parallel: A split on the input columns, B whole
    assert specs[q + ".lora_A.weight"].tp_dim is None and specs[q + ".lora_B.weight"].tp_dim == 0
    assert specs[o + ".lora_A.weight"].tp_dim == 1 and specs[o + ".lora_B.weight"].tp_dim is None
    assert specs[k + ".lora_B.weight"].tp_units == cfg.n_kv_heads  # whole KV heads, like k_proj itself
    assert specs[q + ".lora_A.weight"].shape == (4, 64) and specs[q + ".lora_B.weight"].shape == (64, 4)
    n = sum(s.numel for s in specs.values() if is_adapter(s.name))
    assert n == cfg.adapter_params == cfg.trained_params
    assert cfg.allocated_params == dataclasses.replace(cfg, lora=None).allocated_params + n


def model_config_from_hf_dict():
    from transformers import LlamaConfig

    from model_helpers import tiny_hf_config

    c = tiny_hf_config(kv_heads=2)
    assert isinstance(c, LlamaConfig)
    return model_config_from_hf(c.to_dict())


def test_lora_train_step_matches_the_dense_formula_in_every_layout(pool, gqa):
    hf, path = gqa
    cfg = dataclasses.replace(model_config_from_hf(path), lora=LORA)
    adapters = _adapters(cfg, seed=3)
    mbs = _micro_batches(seed=11)
    dense = DenseLoRA(hf, LORA, adapters)
    ref_norm = dense.sgd_step(mbs, max_norm=0.05)  # below the norm: clipping over the adapters only
    cases = [(1, 1, 1, False, True), (1, 2, 1, False, True), (1, 2, 1, False, False), (1, 4, 1, False, True),
             (1, 2, 2, True, True), (2, 1, 2, False, True), (1, 4, 1, True, False)]
    for dp, tp, pp, recompute, sp in cases:
        res = [r for r in pool.run(_train, cfg, dp, tp, pp, str(path), adapters, mbs, 0.05, recompute, sp)
               if r is not None]
        for r in res:
            assert r["frozen_moved"] == [], (dp, tp, pp, r["frozen_moved"])
            assert all(is_adapter(n) for n in r["trained"])
            assert abs(r["stats"]["grad_norm"] - ref_norm) < 1e-5 * max(1.0, ref_norm), (dp, tp, pp, r["stats"])
        got = _assemble_adapters(res, cfg)
        for name, t in got.items():
            err = (t - dense.params[name].detach()).abs().max().item()
            assert err < 2e-6, (dp, tp, pp, recompute, sp, name, err)


def _logprobs(ctx, cfg, tp, pp, path, adapters, batch, sp):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path, sequence_parallel=sp)
    if model is None:
        return None
    _set_adapters(model, adapters)
    on = model.forward(batch)
    with model.adapters_disabled():
        off = model.forward(batch)
    again = model.forward(batch)
    return None if on is None else (on, off, again)


def test_adapters_off_is_the_base_model_and_on_is_the_dense_lora_model(pool, gqa):
    hf, path = gqa
    cfg = dataclasses.replace(model_config_from_hf(path), lora=LORA)
    adapters = _adapters(cfg, seed=4)
    mb = _micro_batches(seed=5, n=1, rows=3)[0]
    dense = DenseLoRA(hf, LORA, adapters)
    with torch.no_grad():
        want_on, mask = dense.logprobs(mb["input_ids"], mb["lengths"])
        want_off, _ = hf_token_logprobs(hf, mb["input_ids"], mask), None
    for tp, pp, sp in [(1, 1, True), (2, 2, True), (4, 1, False), (2, 1, True)]:
        res = [r for r in pool.run(_logprobs, cfg, tp, pp, str(path), adapters, mb, sp) if r is not None]
        for on, off, again in res:
            assert (on - want_on).abs().max() < 1e-5, (tp, pp)
            assert (off - want_off).abs().max() < 1e-5, (tp, pp)
            assert torch.equal(on, again)  # switched back on
            assert (on - off).abs().max() > 1e-3  # the adapters do something


def _train_dropout(ctx, cfg, tp, pp, path, adapters, mbs, recompute):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path)
    if model is None:
        return None
    _set_adapters(model, adapters)
    opt = torch.optim.SGD(list(model.trained_params().values()), lr=1.0)
    stats = [model.train_step(mbs, nll_loss, opt, recompute=recompute) for _ in range(2)]
    return {**local_shards(model), "stats": stats}


def test_dropout_masks_are_the_same_in_every_tp_layout_and_under_recomputation(pool, gqa):
    # Masks come from a generator seeded the same on every tp rank and are drawn for the whole input: tp 1, 2
    # and 4, with and without recomputation (which replays the masks), train the same adapters.
    hf, path = gqa
    lora = dataclasses.replace(LORA, dropout=0.3)
    cfg = dataclasses.replace(model_config_from_hf(path), lora=lora)
    adapters = _adapters(cfg, seed=6)
    mbs = _micro_batches(seed=12, n=2)
    runs = {}
    for tp, pp, recompute in [(1, 1, False), (1, 1, True), (2, 1, False), (4, 1, True)]:
        res = [r for r in pool.run(_train_dropout, cfg, tp, pp, str(path), adapters, mbs, recompute)
               if r is not None]
        runs[(tp, recompute)] = _assemble_adapters(res, cfg), res[0]["stats"]
    base, base_stats = runs[(1, False)]
    no_dropout = DenseLoRA(hf, LORA, adapters)
    no_dropout.sgd_step(mbs, max_norm=float("inf"))
    assert any((base[n] - no_dropout.params[n].detach()).abs().max() > 1e-4 for n in base)  # dropout acts
    for key, (got, stats) in runs.items():
        for n in got:
            assert (got[n] - base[n]).abs().max() < 1e-5, (key, n)
        assert abs(stats[1]["loss"] - base_stats[1]["loss"]) < 1e-5, key


def _train_critic(ctx, cfg, tp, pp, path, adapters, mbs):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path)
    if model is None:
        return None
    _set_adapters(model, adapters)
    opt = torch.optim.SGD(list(model.trained_params().values()), lr=1.0)

    def value_loss(out, mb):
        valid = (out.layout.segment_ids >= 0).float()
        return (((out.values - mb["targets"]) ** 2) * valid).sum() / valid.sum(), {}

    model.train_step(mbs, value_loss, opt)
    return {**local_shards(model), "trained": sorted(model.trained_params())}


def test_a_lora_critic_trains_its_adapters_and_its_scalar_head_like_the_dense_formula(pool, tmp_path):
    hf = tiny_hf_model(tmp_path, seed=5, critic=True)
    cfg = dataclasses.replace(model_config_from_hf(tmp_path), lora=LORA)
    adapters = _adapters(cfg, seed=7)
    g = torch.Generator().manual_seed(8)
    mbs = [dict(mb, targets=torch.randn(mb["input_ids"].shape, generator=g)) for mb in _micro_batches(seed=9, n=2)]
    dense = DenseLoRA(hf, LORA, adapters)
    score = dense.hf.score.weight
    score.requires_grad_(True)  # the head is new for a critic: it trains with the adapters
    for mb in mbs:
        ids, lens = mb["input_ids"], mb["lengths"]
        mask = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
        values = dense.hf.score(dense.hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0]
        ((((values - mb["targets"]) ** 2) * mask).sum() / mask.sum() / len(mbs)).backward()
    want = {n: (p - p.grad).detach() for n, p in dense.params.items()}
    want["score.weight"] = (score - score.grad).detach()
    for tp, pp in [(1, 1), (2, 2)]:
        res = [r for r in pool.run(_train_critic, cfg, tp, pp, str(tmp_path), adapters, mbs) if r is not None]
        for r in res:
            assert r["trained"] == sorted(n for n in r["shards"] if is_adapter(n) or n == "score.weight")
            assert ("score.weight" in r["trained"]) == (r["pp"] == pp - 1)
        got = _assemble_adapters(res, cfg)
        head = next(r["shards"]["score.weight"] for r in res if "score.weight" in r["shards"])
        assert (head - want["score.weight"]).abs().max() < 1e-5, (tp, pp)
        for name, t in got.items():
            assert (t - want[name]).abs().max() < 1e-5, (tp, pp, name)


def _train_adamw(ctx, cfg, dp, path, adapters, mbs, bf16=False):
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.models.hf_io import load_hf_checkpoint
    from realloc.strategy import ParallelStrategy

    layout = ModelLayout.for_model(cfg, tuple(range(dp)), ParallelStrategy(dp, 1, 1))
    ctx.groups.ensure_layouts([layout])
    if ctx.rank >= dp:
        return None
    model = ParallelModel(cfg, ctx.groups.model_groups(layout), init="empty",
                          dtype=torch.bfloat16 if bf16 else torch.float32)
    load_hf_checkpoint(model, path)
    _set_adapters(model, adapters)
    before = {n: p.detach().clone() for n, p in model.params().items()}
    opt = model.make_optimizer(lr=1e-2)  # DistributedAdamW over the adapters at dp 2
    per = len(mbs) // dp
    model.train_step(mbs[model.groups.dp_rank * per:(model.groups.dp_rank + 1) * per], nll_loss, opt)
    moved = sorted(n for n, p in model.params().items() if not torch.equal(p, before[n]))
    return {**local_shards(model), "moved": moved, "opt": type(opt).__name__}


def test_model_optimizers_hold_and_step_the_adapters_only(pool, gqa):
    # AdamW's first step moves every element it owns by about lr; the frozen base stays bit for bit.
    _, path = gqa
    cfg = dataclasses.replace(model_config_from_hf(path), lora=LORA)
    adapters = _adapters(cfg, seed=10)
    mbs = _micro_batches(seed=13)
    kinds = {(1, False): "AdamW", (2, False): "DistributedAdamW", (1, True): "MasterWeightAdamW",
             (2, True): "DistributedAdamW"}
    for (dp, bf16), kind in kinds.items():
        res = [r for r in pool.run(_train_adamw, cfg, dp, str(path), adapters, mbs, bf16) if r is not None]
        assert {r["opt"] for r in res} == {kind}
        for r in res:
            assert r["moved"] == sorted(adapters), (dp, bf16)


def _generate(ctx, cfg, tp, adapters, mode, base):
    from realloc.models.sampling import GenerationConfig

    model = build_model(ctx, cfg, 1, tp, 1, seed=3)
    if model is None:
        return None
    _set_adapters(model, adapters)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    gconfig = GenerationConfig(max_new_tokens=12, seed=5, greedy=True, decode=mode)
    if base:
        with model.adapters_disabled():
            out = model.generate(prompts, gconfig)
    else:
        out = model.generate(prompts, gconfig)
    return [out.sequences[b, :out.lengths[b]].tolist() for b in range(len(prompts))]


def test_generation_decodes_with_the_adapters_in_eager_and_static_steps(pool):
    # the KV-cache path runs the adapters too: static-shape decoding (the step a CUDA graph captures) gives the
    # eager loop's tokens, and both differ from the base model's
    from realloc.models.config import get_model_config

    cfg = dataclasses.replace(get_model_config("tiny-gqa"), lora=LORA)
    adapters = {n: t * 5 for n, t in _adapters(cfg, seed=11).items()}  # large enough to change greedy tokens
    runs = {}
    for mode, base in (("eager", False), ("static", False), ("eager", True)):
        res = [r for r in pool.run(_generate, cfg, 2, adapters, mode, base) if r is not None]
        assert all(r == res[0] for r in res)
        runs[mode, base] = res[0]
    assert runs["static", False] == runs["eager", False]
    assert runs["eager", True] != runs["eager", False]
