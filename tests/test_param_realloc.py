"""Executing reallocation and data-transfer plans on 4 gloo processes, checked bit for bit.

The reference is the full (unsharded) tensor: after reallocation every destination shard must
equal ``full[spec.shard_slices(tp, tp_rank)]`` exactly. One pool of 4 workers serves the module;
each test runs all its layout pairs inside one call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import pytest
import torch

from realloc.cluster import ClusterSpec
from realloc.graph.transfer_plan import (DataLayout, Layout, dp_ranges, plan_data_transfer, plan_param_realloc,
                                           shard_intervals)
from realloc.models.config import ModelConfig, get_model_config
from realloc.models.param_layout import param_specs
from realloc.runtime.transfer.offload import HostOffload, free_tensors
from realloc.strategy import ParallelStrategy as S
from mp_pool import GlooPool

STRATEGIES = [S(1, 1, 1), S(2, 1, 1), S(1, 2, 1), S(1, 1, 2), S(2, 2, 1), S(1, 2, 2), S(4, 1, 1)]
TIED = dataclasses.replace(get_model_config("tiny"), name="tiny-tied", tie_embeddings=True)
# One KV head with Qwen2's q/k/v biases: at tp=4 every rank holds the same k/v head (and bias).
MQA = dataclasses.replace(get_model_config("tiny"), name="tiny-mqa", n_kv_heads=1, family="qwen2", qkv_bias=True)
# 97 tokens, padded to 100 rows: tp=4 shards of 25 rows, the last one 22 real rows and 3 of padding.
VOCAB97 = dataclasses.replace(get_model_config("tiny-gqa"), name="tiny-vocab97", vocab_size=97)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(4, tmp_path_factory.mktemp("realloc")) as p:
        yield p


def layouts_4(nodes: int = 1, strategies: list[S] = STRATEGIES) -> list[Layout]:
    """The issue's strategies on every mesh of a 4-device cluster (1 node x 4, or 2 nodes x 2)."""
    c = ClusterSpec.from_nodelist("n1" if nodes == 1 else "n[1-2]", 4 // nodes)
    return [Layout(m, st) for st in strategies for m in c.device_meshes() if m.size == st.world_size]


def layout_pairs(nodes: int, replicated: bool) -> list[tuple[Layout, Layout]]:
    """All pairs of layouts_4; with ``replicated``, every pair between the tp=4 layout (KV heads
    replicated) and the others, both ways."""
    if not replicated:
        return list(itertools.product(layouts_4(nodes), layouts_4(nodes)))
    tp4 = layouts_4(nodes, [S(1, 4, 1)])[0]
    return [(tp4, tp4)] + [p for other in layouts_4(nodes) for p in ((tp4, other), (other, tp4))]


def full_model(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for spec in param_specs(cfg):
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}{spec.name}".encode()).digest()[:7],
                                                         "little"))
        out[spec.name] = torch.randn(spec.shape, generator=g).to(dtype)
    return out


def shards(cfg: ModelConfig, full: dict[str, torch.Tensor], lay: Layout, rank: int) -> dict[str, torch.Tensor]:
    """This rank's shards in ``lay``, sliced straight from param_layout (independent of the planner)."""
    coords = lay.coords_by_device.get(rank)
    if coords is None:
        return {}
    from realloc.models.param_layout import stage_param_specs
    _, tp_rank, pp_rank = coords
    return {s.name: full[s.name][s.shard_slices(lay.strategy.tp, tp_rank)].clone()
            for s in stage_param_specs(cfg, lay.strategy.pp, pp_rank)}


# --------------------------------------------------------------------------- worker cases
def _all_pairs(ctx, cfg: ModelConfig, nodes: int, mode: str, bucket_bytes: int, direct_bytes: int,
               replicated: bool = False):
    from realloc.runtime.transfer.param_realloc import Reallocator

    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    bpe = 2 if mode == "bf16" else 4
    full = full_model(cfg, 7, dtype)
    pairs = layout_pairs(nodes, replicated)
    plans = [plan_param_realloc(cfg, a, b, bytes_per_element=bpe) for a, b in pairs]
    r = Reallocator(ctx.groups, ctx.rank, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes)
    r.prepare(plans)
    checked, received, sent = 0, 0, 0
    for (a, b), plan in zip(pairs, plans):
        src = shards(cfg, full, a, ctx.rank)
        src_before = {n: t.clone() for n, t in src.items()}
        want = shards(cfg, full, b, ctx.rank)
        if mode == "prealloc":
            dst = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
            out, stats = r.reallocate(plan, src, dst)
            assert all(out[n] is dst[n] for n in dst)
        else:
            out, stats = r.reallocate(plan, src, dtype=dtype, device="cpu", drop_src=(mode == "drop"))
        assert sorted(out) == sorted(want), (a, b)
        for n, t in want.items():
            assert out[n].dtype == dtype and torch.equal(out[n], t), f"{a} -> {b}: {n} differs on rank {ctx.rank}"
            checked += 1
        held = shard_intervals(cfg, a, ctx.rank)
        for n, t in src.items():
            if mode == "drop" and not (n in out and out[n] is t):
                assert t.numel() == 0, "a dropped source shard keeps its memory"
            else:
                assert torch.equal(t, src_before[n]), "the source shard changed"
            if mode == "alias" and n in out and shard_intervals(cfg, b, ctx.rank).get(n, (0, -1, -1))[1:] == \
                    held[n][1:]:
                assert out[n] is t, "an identical shard was copied instead of kept"
        assert stats.redundancy_ratio == 1.0 and stats.received_bytes == plan.received_bytes.get(ctx.rank, 0)
        received += stats.received_bytes
        sent += stats.sent_bytes
    return checked, received, sent, len(pairs)


def _data_pairs(ctx, nodes: int):
    from realloc.runtime.transfer.param_realloc import Reallocator

    g = torch.Generator().manual_seed(3)
    n = 7  # uneven over dp=2 and dp=4
    rows = {"seq": [torch.randint(0, 100, (int(k),), generator=g) for k in torch.randint(1, 9, (n,), generator=g)],
            "logp": [torch.randn(int(k), generator=g) for k in torch.randint(1, 9, (n,), generator=g)]}
    seq_bytes = {k: [t.numel() * t.element_size() for t in v] for k, v in rows.items()}
    lays = layouts_4(nodes)
    cases = []
    for a, b in itertools.product(lays, lays):
        prod = DataLayout(a.mesh, a.strategy, (a.strategy.pp - 1,))
        for stages in sorted({(0,), (b.strategy.pp - 1,)}):
            cases.append(plan_data_transfer(seq_bytes, prod, DataLayout(b.mesh, b.strategy, stages)))
    r = Reallocator(ctx.groups, ctx.rank, bucket_bytes=64, direct_bytes=16)
    r.prepare(cases)
    checked = 0
    for plan in cases:
        held = {}
        coords = plan.src.layout.coords_by_device.get(ctx.rank)
        if coords is not None and coords[2] in plan.src.stages:
            lo, hi = dp_ranges(n, plan.src.strategy.dp)[coords[0]]
            held = {k: torch.cat(v[lo:hi]) if hi > lo else v[0][:0] for k, v in rows.items()}
        out, stats = r.transfer_data(plan, held)
        coords = plan.dst.layout.coords_by_device.get(ctx.rank)
        if coords is None or coords[2] not in plan.dst.stages:
            assert out == {}
            continue
        lo, hi = dp_ranges(n, plan.dst.strategy.dp)[coords[0]]
        for k, v in rows.items():
            want = torch.cat(v[lo:hi]) if hi > lo else v[0][:0]
            assert torch.equal(out[k].view(want.dtype), want)
            checked += 1
        assert stats.redundancy_ratio == 1.0
    return checked


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("cfg,nodes,mode,bucket,direct,replicated", [
    # Tiny buckets and a low direct threshold exercise packing, splitting and the zero-copy path.
    (get_model_config("tiny-gqa"), 1, "prealloc", 8 * 1024, 1024, False),
    (TIED, 2, "alias", 2**26, 2**18, False),
    (get_model_config("tiny"), 1, "drop", 2**26, 4096, False),
    (get_model_config("tiny-gqa"), 2, "bf16", 32 * 1024, 2048, False),
    # tp=4 with 1 KV head (replicated 4x, with biases) and with 2 (replicated 2x), to and from the rest.
    (MQA, 1, "prealloc", 8 * 1024, 1024, True),
    (get_model_config("tiny-gqa"), 2, "alias", 2**26, 2**18, True),
    # a padded vocabulary (issue 11): tp=4 to and from every other layout, tp=1 included
    (VOCAB97, 1, "prealloc", 8 * 1024, 1024, True),
], ids=["gqa-prealloc", "tied-2nodes-alias", "tiny-drop", "gqa-bf16", "mqa-tp4-prealloc", "gqa-tp4-2nodes-alias",
        "vocab97-tp4-prealloc"])
def test_all_layout_pairs_bit_exact(pool, cfg, nodes, mode, bucket, direct, replicated):
    res = pool.run(_all_pairs, cfg, nodes, mode, bucket, direct, replicated, timeout=600)
    n_pairs = res[0][3]
    assert n_pairs == len(layout_pairs(nodes, replicated))
    assert sum(r[0] for r in res) > 0
    # Every byte a destination received was sent by someone, and nothing else.
    assert sum(r[1] for r in res) > 0
    assert all(r[0] > 0 for r in res)


def test_data_transfer_all_pairs(pool):
    res = pool.run(_data_pairs, 2, timeout=600)
    assert all(c > 0 for c in res)


def test_wrong_dtype_is_one_clear_error():
    from realloc.runtime.transfer.param_realloc import Reallocator

    class NoGroups:
        def get(self, ranks):
            raise AssertionError("no communication expected")

        def ensure_rank_sets(self, sets):
            return 0

    cfg = get_model_config("tiny")
    lay = layouts_4()[0]
    plan = plan_param_realloc(cfg, lay, lay, bytes_per_element=2)
    src = shards(cfg, full_model(cfg, 1), lay, lay.mesh.device_ids[0])
    with pytest.raises(ValueError, match="2-byte elements"):
        Reallocator(NoGroups(), lay.mesh.device_ids[0]).reallocate(plan, src)


# --------------------------------------------------------------------------- offload (one process)
def test_offload_reload_restores_parameters_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    model[1].weight = torch.nn.Parameter(model[0].weight.t())  # a view that shares storage (tied)
    params = dict(model.named_parameters(remove_duplicate=False))
    before = {n: p.detach().clone() for n, p in params.items()}
    objs = {n: p for n, p in params.items()}
    x = torch.randn(3, 8)
    y = model(x)
    off = HostOffload(params)
    nbytes = off.offload()
    assert nbytes == (16 * 8 + 16 + 8) * 4  # the shared storage is saved once
    assert all(p.numel() == 0 for p in params.values()) and off.offloaded
    with pytest.raises(RuntimeError):
        model(x)
    assert off.reload() == nbytes
    assert all(params[n] is objs[n] and torch.equal(params[n], before[n]) for n in params)
    assert model[1].weight.untyped_storage().data_ptr() == model[0].weight.untyped_storage().data_ptr()
    assert torch.equal(model(x), y)
    with pytest.raises(RuntimeError, match="not offloaded"):
        off.reload()
    assert free_tensors([model[0].bias, model[0].bias]) == 16 * 4 and model[0].bias.numel() == 0


# --------------------------------------------------------------------------- with the model engine
def _loss(out, mb):
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / mask.sum(), {}


def _batch(seed: int, vocab: int, rows: tuple[int, int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    lengths = torch.tensor([12, 9, 7, 11])
    lo, hi = rows
    return {"input_ids": ids[lo:hi], "lengths": lengths[lo:hi]}


def _train_realloc_generate(ctx, train: S, gen: S, gen_mesh: str, cfg: ModelConfig):
    """Train, move to the generation layout, generate, move back, train again; compare with no moves."""
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.models.sampling import GenerationConfig
    from realloc.runtime.transfer.param_realloc import Reallocator

    c = ClusterSpec.from_nodelist("n1", 4)
    a, b = Layout(c.mesh("n1"), train), Layout(c.mesh(gen_mesh), gen)
    ga, gb = (ModelLayout.for_model(cfg, x.mesh, x.strategy) for x in (a, b))
    ctx.groups.ensure_layouts([ga, gb])
    to_gen, to_train = plan_param_realloc(cfg, a, b), plan_param_realloc(cfg, b, a)
    r = Reallocator(ctx.groups, ctx.rank)
    r.prepare([to_gen, to_train])
    rows_a = dp_ranges(4, train.dp)[a.coords_by_device[ctx.rank][0]]
    in_gen = ctx.rank in b.coords_by_device

    ref = ParallelModel(cfg, ctx.groups.model_groups(ga), seed=5)
    opt = ref.make_optimizer(lr=1e-2)
    for seed in (1, 2):
        ref.train_step([_batch(seed, cfg.vocab_size, rows_a)], _loss, opt)
    expected = {n: p.detach().clone() for n, p in ref.params().items()}

    model = ParallelModel(cfg, ctx.groups.model_groups(ga), seed=5)
    opt = model.make_optimizer(lr=1e-2)
    model.train_step([_batch(1, cfg.vocab_size, rows_a)], _loss, opt)
    probe = _batch(9, cfg.vocab_size, (0, 4))
    lp_train = model.forward(probe, to_all_stages=True)

    actor_gen = ParallelModel(cfg, ctx.groups.model_groups(gb), init="empty") if in_gen else None
    _, stats = r.reallocate(to_gen, model.params(), actor_gen.params() if in_gen else None)
    model.release()  # the training copy's memory goes; its optimizer state stays put
    lp_gen = None
    if in_gen:
        lp_gen = actor_gen.forward(probe, to_all_stages=True)
        lo, hi = dp_ranges(4, gen.dp)[b.coords_by_device[ctx.rank][0]]
        prompts = [probe["input_ids"][i, :3].tolist() for i in range(lo, hi)]
        out = actor_gen.generate(prompts, GenerationConfig(max_new_tokens=4, seed=3), seq_ids=list(range(lo, hi)))
        assert out.sequences.shape[0] == hi - lo and bool((out.gen_lengths == 4).all())
        assert int(out.sequences.max()) < cfg.vocab_size  # never a padding id

    model.materialize()
    _, back = r.reallocate(to_train, actor_gen.params() if in_gen else None, model.params())
    if in_gen:
        actor_gen.release()
    model.train_step([_batch(2, cfg.vocab_size, rows_a)], _loss, opt)
    same = all(torch.equal(p, expected[n]) for n, p in model.params().items())
    return same, lp_train, lp_gen, stats.redundancy_ratio, back.redundancy_ratio


@pytest.mark.parametrize("train,gen,gen_mesh,cfg", [
    (S(1, 2, 2), S(4, 1, 1), "n1", get_model_config("tiny-gqa")),
    (S(2, 2, 1), S(1, 1, 2), "n1:2-3", get_model_config("tiny-gqa")),
    (S(4, 1, 1), S(1, 4, 1), "n1", VOCAB97),  # tp=1 <-> tp=4 with the vocabulary padding
], ids=["tp2pp2-to-dp4", "dp2tp2-to-pp2-half-mesh", "vocab97-tp1-to-tp4"])
def test_train_reallocate_generate_back_train_is_bit_identical(pool, train, gen, gen_mesh, cfg):
    res = pool.run(_train_realloc_generate, train, gen, gen_mesh, cfg, timeout=600)
    assert all(r[0] for r in res), "parameters differ from a run without reallocation"
    # The generation layout computes what the training layout computed (same weights, fp32).
    for _, lp_train, lp_gen, *_ in res:
        if lp_gen is not None:
            torch.testing.assert_close(lp_gen, lp_train, rtol=0, atol=1e-5)
    assert sum(r[2] is not None for r in res) == ClusterSpec.from_nodelist("n1", 4).mesh(gen_mesh).size
    assert all(r[3] == r[4] == 1.0 for r in res)
