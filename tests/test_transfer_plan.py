"""The pure reallocation / data-transfer planner, checked against hand counts and brute force."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from realloc.cluster import ClusterSpec, DeviceMesh
from realloc.graph.transfer_plan import (DataLayout, Layout, dp_ranges, plan_data_transfer,
                                           plan_param_realloc)
from realloc.models.config import ModelConfig, get_model_config
from realloc.models.param_layout import param_specs, stage_param_specs
from realloc.strategy import ParallelStrategy as S

STRATEGIES = [S(1, 1, 1), S(2, 1, 1), S(1, 2, 1), S(1, 1, 2), S(2, 2, 1), S(1, 2, 2), S(4, 1, 1)]
TINY = get_model_config("tiny")
TINY_GQA = get_model_config("tiny-gqa")
# Tied embeddings make the last stage hold a replica of the embedding when pp > 1.
TIED = dataclasses.replace(TINY, name="tiny-tied", tie_embeddings=True)


def cluster(nodes: int, per_node: int) -> ClusterSpec:
    return ClusterSpec.from_nodelist(f"n[1-{nodes}]" if nodes > 1 else "n1", per_node)


def meshes_of_size(c: ClusterSpec, size: int) -> list[DeviceMesh]:
    return [m for m in c.device_meshes() if m.size == size]


# --------------------------------------------------------------------------- brute force
def holdings(cfg: ModelConfig, lay: Layout) -> dict[int, dict[str, np.ndarray]]:
    """device -> name -> boolean mask of the full tensor it holds, straight from param_layout."""
    full = {s.name: s.shape for s in param_specs(cfg)}
    out: dict[int, dict[str, np.ndarray]] = {}
    st = lay.strategy
    for rank, dev in enumerate(lay.mesh.device_ids):
        _, tp_rank, pp_rank = st.coords(rank)
        masks = {}
        for spec in stage_param_specs(cfg, st.pp, pp_rank):
            m = np.zeros(full[spec.name], dtype=bool)
            m[spec.shard_slices(st.tp, tp_rank)] = True
            masks[spec.name] = m
        out[dev] = masks
    return out


def check_param_plan(cfg: ModelConfig, src: Layout, dst: Layout, bpe: int = 4) -> None:
    plan = plan_param_realloc(cfg, src, dst, bytes_per_element=bpe)
    shapes = {s.name: s.shape for s in param_specs(cfg)}
    have, need = holdings(cfg, src), holdings(cfg, dst)
    node = {d: d // src.mesh.devices_per_node for d in set(have) | set(need)}
    got = {d: {n: np.zeros(shapes[n], dtype=np.int32) for n in masks} for d, masks in need.items()}
    copied = {d: {n: np.zeros(shapes[n], dtype=np.int32) for n in masks} for d, masks in need.items()}
    moved = intra = 0
    for t in plan.transfers:
        piece = np.zeros(shapes[t.name], dtype=bool)
        piece[t.slices(shapes[t.name])] = True
        assert t.nbytes == piece.sum() * bpe
        assert have[t.src][t.name][piece].all(), f"source {t.src} does not hold {t}"
        assert len(set(t.dsts)) == len(t.dsts) and t.src not in t.dsts
        for d in t.dsts:
            got[d][t.name][piece] += 1
            moved += t.nbytes
            intra += t.nbytes if node[d] == node[t.src] else 0
    for c in plan.local_copies:
        piece = np.zeros(shapes[c.name], dtype=bool)
        piece[c.slices(shapes[c.name])] = True
        assert have[c.device][c.name][piece].all()
        copied[c.device][c.name][piece] += 1
    minimal = 0
    for d, masks in need.items():
        for n, want in masks.items():
            held = have.get(d, {}).get(n, np.zeros_like(want))
            r, cp = got[d][n], copied[d][n]
            assert r.max(initial=0) <= 1 and cp.max(initial=0) <= 1, f"device {d} gets {n} twice"
            assert not (r.astype(bool) & held).any(), f"device {d} receives part of {n} it holds"
            assert ((r + cp) == want).all(), f"device {d}: received + copied != needed for {n}"
            assert (cp.astype(bool) == (held & want)).all()
            minimal += int((want & ~held).sum()) * bpe
    assert plan.minimal_bytes == minimal
    assert plan.moved_bytes == moved
    assert plan.intra_node_bytes == intra and plan.inter_node_bytes == moved - intra
    assert sum(plan.received_bytes.values()) == moved == sum(plan.sent_bytes.values())
    assert plan.redundancy_ratio == 1.0


# --------------------------------------------------------------------------- hand-computed
# tiny: h=64, kv=64, inter=176, vocab=64, 4 layers, untied LM head. Per block, the tp-sharded
# weights have 4*64*64 + 3*176*64 = 50176 elements and the two norms 128; embedding and
# LM head 4096 each; final norm 64.
BLOCK_SHARDED, BLOCK_REPL, EMB, HEAD, NORM = 50176, 128, 4096, 4096, 64


def test_tiny_counts_match_hand_numbers():
    assert 4 * (BLOCK_SHARDED + BLOCK_REPL) + EMB + HEAD + NORM == TINY.total_params


def test_identical_layouts_move_nothing():
    c = cluster(1, 4)
    for st in STRATEGIES:
        for mesh in meshes_of_size(c, st.world_size):
            lay = Layout(mesh, st)
            for cfg in (TINY, TIED):
                plan = plan_param_realloc(cfg, lay, lay)
                assert plan.empty and plan.moved_bytes == plan.minimal_bytes == 0 and plan.transfers == ()
                assert plan.redundancy_ratio == 1.0
                assert len(plan.local_copies) == sum(len(stage_param_specs(cfg, st.pp, r)) for r in range(st.pp)) \
                    * st.dp * st.tp


def test_disjoint_single_devices_move_the_whole_model():
    c = cluster(2, 2)
    plan = plan_param_realloc(TINY, Layout(c.mesh("n1:0"), S(1, 1, 1)), Layout(c.mesh("n2:1"), S(1, 1, 1)),
                              bytes_per_element=2)
    assert plan.moved_bytes == plan.minimal_bytes == TINY.total_params * 2
    assert plan.inter_node_bytes == plan.moved_bytes and plan.intra_node_bytes == 0
    assert plan.sent_bytes == {0: TINY.total_params * 2} and plan.received_bytes == {3: TINY.total_params * 2}
    assert all(t.src == 0 and t.dsts == (3,) for t in plan.transfers)
    assert plan.local_copies == ()


def test_tp_1_to_2_on_same_devices_moves_exactly_the_missing_half():
    c = cluster(1, 4)
    one, two = Layout(c.mesh("n1:0"), S(1, 1, 1)), Layout(c.mesh("n1:0-1"), S(1, 2, 1))
    up = plan_param_realloc(TINY, one, two)
    # Device 1 needs its half of every sharded weight and every norm; device 0 holds all it needs.
    assert up.moved_bytes == 4 * (4 * (BLOCK_SHARDED // 2 + BLOCK_REPL) + EMB // 2 + HEAD // 2 + NORM)
    assert up.received_bytes == {1: up.moved_bytes}
    q = [t for t in up.transfers if t.name == "model.layers.0.self_attn.q_proj.weight"]
    assert [(t.src, t.dsts, t.axis, t.lo, t.hi) for t in q] == [(0, (1,), 0, 32, 64)]
    down = plan_param_realloc(TINY, two, one)
    # Device 0 lacks only the other half of the sharded weights; the norms are replicated.
    assert down.moved_bytes == 4 * (4 * BLOCK_SHARDED // 2 + EMB // 2 + HEAD // 2)
    o = [t for t in down.transfers if t.name == "model.layers.3.self_attn.o_proj.weight"]
    assert [(t.src, t.dsts, t.axis, t.lo, t.hi) for t in o] == [(1, (0,), 1, 32, 64)]
    # Two full replicas already hold everything a tp=2 layout needs.
    assert plan_param_realloc(TINY, Layout(c.mesh("n1:0-1"), S(2, 1, 1)), two).empty


def test_tp_2_to_4_sends_sub_slices_of_source_shards():
    c = cluster(1, 4)
    plan = plan_param_realloc(TINY, Layout(c.mesh("n1:0-1"), S(1, 2, 1)), Layout(c.mesh("n1"), S(1, 4, 1)))
    gate = sorted((t.src, t.dsts, t.lo, t.hi) for t in plan.transfers if t.name == "model.layers.1.mlp.gate_proj.weight")
    # Device 0 keeps rows 0-43 of its 0-87; device 1 held 88-175 but needs 44-87; devices 2, 3 need
    # the quarters of device 1's half.
    assert gate == [(0, (1,), 44, 88), (1, (2,), 88, 132), (1, (3,), 132, 176)]
    assert plan.moved_bytes == 4 * 3 * (4 * (BLOCK_SHARDED // 4) + EMB // 4 + HEAD // 4) + 4 * (2 * (4 * BLOCK_REPL + NORM))


def test_pp_change():
    c = cluster(1, 4)
    one, pp2 = Layout(c.mesh("n1:0"), S(1, 1, 1)), Layout(c.mesh("n1:0-1"), S(1, 1, 2))
    stage1 = 2 * (BLOCK_SHARDED + BLOCK_REPL) + HEAD + NORM
    for a, b, dst in ((one, pp2, 1), (pp2, one, 0)):
        plan = plan_param_realloc(TINY, a, b)
        assert plan.moved_bytes == 4 * stage1 and plan.received_bytes == {dst: 4 * stage1}
        assert {t.name.split(".")[2] for t in plan.transfers if t.name.startswith("model.layers")} == {"2", "3"}
    # A tied LM head with pp=2 keeps an embedding replica on the last stage, which must be filled.
    tied = plan_param_realloc(TIED, one, pp2)
    assert tied.moved_bytes == 4 * (stage1 - HEAD + EMB)
    assert any(t.name == "model.embed_tokens.weight" and t.dsts == (1,) for t in tied.transfers)


def test_equal_cost_sources_are_balanced_over_replicas():
    c = cluster(1, 4)
    plan = plan_param_realloc(TINY, Layout(c.mesh("n1:0-1"), S(2, 1, 1)), Layout(c.mesh("n1"), S(4, 1, 1)))
    full = TINY.total_params * 4
    assert dict(plan.sent_bytes) == {0: full, 1: full}
    assert dict(plan.received_bytes) == {2: full, 3: full}
    # Two new replicas, one source for all of them: one broadcast per tensor to both.
    plan = plan_param_realloc(TINY, Layout(c.mesh("n1:0"), S(1, 1, 1)), Layout(c.mesh("n1"), S(4, 1, 1)))
    assert {t.dsts for t in plan.transfers} == {(1, 2, 3)} and plan.groups == ((0, 1, 2, 3),)
    assert plan.source_bytes == {0: full} and plan.sent_bytes == {0: 3 * full}


def test_same_node_sources_are_preferred():
    c = cluster(2, 2)  # node 0 = devices 0, 1; node 1 = devices 2, 3
    # dp replica 0 = {0, 1}, replica 1 = {2, 3}. Each device lacks the other tp half, which is
    # held both by its tp neighbour on the same node and by one on the other node.
    plan = plan_param_realloc(TINY, Layout(c.mesh("n[1-2]"), S(2, 2, 1)), Layout(c.mesh("n[1-2]"), S(4, 1, 1)))
    assert plan.inter_node_bytes == 0 and plan.intra_node_bytes == plan.moved_bytes > 0
    check_param_plan(TINY, Layout(c.mesh("n[1-2]"), S(2, 2, 1)), Layout(c.mesh("n[1-2]"), S(4, 1, 1)))


@pytest.mark.parametrize("cfg", [TINY_GQA, TIED], ids=lambda c: c.name)
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_all_layout_pairs_brute_force(cfg, shape):
    """Every pair of the issue's layouts on every mesh of a 4-device cluster: overlapping and disjoint."""
    c = cluster(*shape)
    layouts = [Layout(m, st) for st in STRATEGIES for m in meshes_of_size(c, st.world_size)]
    n_disjoint = 0
    for a, b in itertools.product(layouts, layouts):
        check_param_plan(cfg, a, b)
        n_disjoint += not a.mesh.overlaps(b.mesh)
    assert n_disjoint > 50


# 8 heads of width 8, so tp=8 is legal; 1 or 2 KV heads are then replicated on 8 or 4 ranks.
WIDE_MQA = ModelConfig("wide-mqa", 64, 64, 176, 2, 8, 1, family="qwen2", qkv_bias=True)
WIDE_GQA = ModelConfig("wide-gqa", 64, 64, 176, 2, 8, 2)


@pytest.mark.parametrize("cfg", [WIDE_MQA, WIDE_GQA], ids=lambda c: c.name)
def test_replicated_kv_head_layouts_brute_force(cfg):
    """Layouts whose tp exceeds the KV heads, to and from layouts that split or hold them whole."""
    c = cluster(1, 8)
    layouts = [Layout(c.mesh("n1"), st) for st in (S(1, 8, 1), S(2, 4, 1), S(1, 4, 2), S(4, 2, 1), S(8, 1, 1))]
    layouts += [Layout(c.mesh("n1:0-3"), S(1, 4, 1)), Layout(c.mesh("n1:4-7"), S(1, 4, 1)),
                Layout(c.mesh("n1:6-7"), S(1, 2, 1)), Layout(c.mesh("n1:5"), S(1, 1, 1))]
    for a, b in itertools.product(layouts, layouts):
        check_param_plan(cfg, a, b)


def test_replicated_kv_head_is_one_broadcast_to_the_ranks_sharing_it():
    c = cluster(1, 4)
    plan = plan_param_realloc(WIDE_MQA, Layout(c.mesh("n1:0"), S(1, 1, 1)), Layout(c.mesh("n1"), S(1, 4, 1)))
    k = [t for t in plan.transfers if t.name == "model.layers.0.self_attn.k_proj.weight"]
    # the one KV head (8 rows of 64) goes whole from device 0 to the 3 others; device 0 copies it
    assert [(t.src, t.dsts, t.lo, t.hi, t.nbytes) for t in k] == [(0, (1, 2, 3), 0, 8, 8 * 64 * 4)]
    assert plan.redundancy_ratio == 1.0
    q = [t for t in plan.transfers if t.name == "model.layers.0.self_attn.q_proj.bias"]
    assert sorted((t.dsts, t.lo, t.hi) for t in q) == [((1,), 16, 32), ((2,), 32, 48), ((3,), 48, 64)]


def test_large_model_plan_counts_and_cache():
    cfg = get_model_config("llama3-70b")
    c = cluster(16, 8)
    a = Layout(c.mesh("n[1-16]"), S(4, 8, 4))
    b = Layout(c.mesh("n[1-16]"), S(16, 8, 1))
    plan = plan_param_realloc(cfg, a, b, bytes_per_element=2)
    assert plan.redundancy_ratio == 1.0
    # Each generation device needs its tp rank's shard of the whole model. Mesh rank order keeps a
    # device's tp rank, so the 32 devices of training stage r already hold that stage's part.
    per_device = 2 * sum(s.shard_numel(8) for s in param_specs(cfg))
    held = sum(32 * 2 * sum(s.shard_numel(8) for s in stage_param_specs(cfg, 4, r)) for r in range(4))
    assert plan.minimal_bytes == 128 * per_device - held == 128 * per_device * 3 // 4
    assert plan_param_realloc(cfg, a, b, bytes_per_element=2) is plan


def test_bad_layouts_raise_one_clear_error():
    c = cluster(1, 4)
    odd = dataclasses.replace(TINY, name="odd", intermediate_size=178)
    with pytest.raises(ValueError, match=r"tp=4 must divide the MLP intermediate size \(178\) of odd"):
        plan_param_realloc(odd, Layout(c.mesh("n1:0"), S(1, 1, 1)), Layout(c.mesh("n1"), S(1, 4, 1)))
    # a vocabulary tp does not divide is padded (66 -> 68 rows), so its layouts plan
    odd_vocab = dataclasses.replace(TINY, name="odd-vocab", vocab_size=66)
    c2 = cluster(2, 4)
    plan = plan_param_realloc(odd_vocab, Layout(c2.mesh("n2:0"), S(1, 1, 1)), Layout(c2.mesh("n1"), S(1, 4, 1)),
                              bytes_per_element=2)
    # every padded row moves (the embedding and LM head have 68 rows), and the 9 norms go to all 4 ranks
    assert odd_vocab.allocated_params == odd_vocab.total_params + 2 * 2 * 64 == TINY.total_params + 2 * 4 * 64
    assert plan.moved_bytes == (odd_vocab.allocated_params + 3 * 9 * 64) * 2
    with pytest.raises(ValueError, match="dp\\*tp\\*pp = 2 but the mesh has 4 devices"):
        Layout(c.mesh("n1"), S(1, 2, 1))


# --------------------------------------------------------------------------- data
def check_data_plan(seq_bytes, prod: DataLayout, cons: DataLayout, cached=None) -> None:
    plan = plan_data_transfer(seq_bytes, prod, cons, cached=cached)
    cached = cached or {}
    have: dict[int, dict[str, set[int]]] = {}
    for rank, dev in enumerate(prod.mesh.device_ids):
        dp, _, pp = prod.strategy.coords(rank)
        if pp in prod.stages:
            have[dev] = {k: set(range(*dp_ranges(len(v), prod.strategy.dp)[dp])) for k, v in seq_bytes.items()}
    moved = minimal = 0
    got: dict[tuple[int, str], list[int]] = {}
    for t in plan.transfers:
        assert set(range(t.lo, t.hi)) <= have[t.src][t.name]
        assert t.nbytes == sum(seq_bytes[t.name][t.lo:t.hi])
        for d in t.dsts:
            got.setdefault((d, t.name), []).extend(range(t.lo, t.hi))
            moved += t.nbytes
    for rank, dev in enumerate(cons.mesh.device_ids):
        dp, _, pp = cons.strategy.coords(rank)
        if pp not in cons.stages:
            continue
        for k, v in seq_bytes.items():
            want = set(range(*dp_ranges(len(v), cons.strategy.dp)[dp]))
            held = set(have.get(dev, {}).get(k, ()))
            for ck, lo, hi in cached.get(dev, ()):
                if ck == k:
                    held |= set(range(lo, hi))
            recv = got.get((dev, k), [])
            assert len(recv) == len(set(recv)) and not set(recv) & held
            assert set(recv) == want - held
            minimal += sum(v[i] for i in want - held)
    assert plan.moved_bytes == moved == plan.minimal_bytes == minimal
    assert plan.redundancy_ratio == 1.0


def test_data_hand_counts():
    c = cluster(1, 4)
    sizes = {"seq": [10, 20, 30, 40]}
    prod = DataLayout(c.mesh("n1:0-1"), S(2, 1, 1), (0,))
    plan = plan_data_transfer(sizes, prod, DataLayout(c.mesh("n1:2-3"), S(1, 2, 1), (0,)))
    assert sorted((t.src, t.dsts, t.lo, t.hi, t.nbytes) for t in plan.transfers) == [
        (0, (2, 3), 0, 2, 30), (1, (2, 3), 2, 4, 70)]
    assert plan.moved_bytes == 200 and plan.groups == ((0, 2, 3), (1, 2, 3))
    # The producer's device 0 keeps its half; only the other half moves.
    plan = plan_data_transfer(sizes, prod, DataLayout(c.mesh("n1:0"), S(1, 1, 1), (0,)))
    assert [(t.src, t.dsts, t.lo, t.hi) for t in plan.transfers] == [(1, (0,), 2, 4)]
    # tp replicas of one producer dp rank share the sending.
    plan = plan_data_transfer(sizes, DataLayout(c.mesh("n1:0-1"), S(1, 2, 1), (0,)),
                              DataLayout(c.mesh("n1:2-3"), S(2, 1, 1), (0,)))
    assert sorted(t.src for t in plan.transfers) == [0, 1]
    # Same layout, or data already cached: nothing moves.
    assert plan_data_transfer(sizes, prod, prod).empty
    assert plan_data_transfer(sizes, prod, DataLayout(c.mesh("n1:0"), S(1, 1, 1), (0,)),
                              cached={0: [("seq", 2, 4)]}).empty


def test_data_all_layout_pairs_brute_force():
    rng = np.random.default_rng(0)
    c = cluster(2, 2)
    sizes = {"seq": rng.integers(1, 100, 8).tolist(), "logp": rng.integers(1, 100, 8).tolist()}
    layouts = [(m, st) for st in STRATEGIES for m in meshes_of_size(c, st.world_size)]
    for (m1, s1), (m2, s2) in itertools.product(layouts, layouts):
        prod = DataLayout(m1, s1, (s1.pp - 1,))
        for stages in {(0,), (s2.pp - 1,), tuple(range(s2.pp))}:
            check_data_plan(sizes, prod, DataLayout(m2, s2, stages))
    m = c.mesh("n[1-2]")
    check_data_plan(sizes, DataLayout(m, S(4, 1, 1), (0,)), DataLayout(m, S(1, 2, 2), (1,)),
                    cached={2: [("seq", 0, 3)], 3: [("logp", 5, 8)]})
    # Uneven batches: 7 sequences over dp=2 and dp=4.
    odd = {"seq": rng.integers(1, 100, 7).tolist()}
    check_data_plan(odd, DataLayout(m, S(2, 2, 1), (0,)), DataLayout(m, S(4, 1, 1), (0,)))


def test_data_bad_input():
    c = cluster(1, 4)
    lay = DataLayout(c.mesh("n1:0"), S(1, 1, 1), (0,))
    with pytest.raises(ValueError, match="stages"):
        DataLayout(c.mesh("n1:0-1"), S(1, 1, 2), (2,))
    with pytest.raises(ValueError, match="'seq'.*non-negative"):
        plan_data_transfer({"seq": [1, -1]}, lay, lay)


def test_hybridflow_table2_example_volumes():
    """hybridflow.txt §5 (Figure 8, Table 2): train p-t-d = 1-4-2 -> generate 1-2-(d_g=2)-2 on 8 GPUs.

    With Megatron rank order in both layouts (tp fastest, which realloc uses everywhere), device d
    holds train tp chunk d % 4 and needs generation chunk d % 2 of every sharded weight: devices
    0, 3 (mod 4) already hold half of what they need and receive 1/4 of the tensor, devices 1, 2
    (mod 4) hold none of it and receive 1/2. HybridFlow-V's all-gather moves (tp - 1)/tp = 3/4 per
    device; HybridFlow's regrouped generation layout moves (d_g - 1)/(t p) = 1/4 per device.
    """
    c = cluster(1, 8)
    plan = plan_param_realloc(get_model_config("llama2-7b"), Layout(c.mesh("n1"), S(2, 4, 1)),
                              Layout(c.mesh("n1"), S(4, 2, 1)), bytes_per_element=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    full = 4096 * 4096 * 2
    got = {d: 0 for d in range(8)}
    for t in plan.transfers:
        if t.name == name:
            for d in t.dsts:
                got[d] += t.nbytes
    assert [got[d] * 4 // full for d in range(8)] == [1, 2, 2, 1, 1, 2, 2, 1]  # in quarters of the tensor
    mean = sum(got.values()) / 8 / full
    assert mean == 0.375 and 0.25 < mean < 0.75  # between HybridFlow (1/4) and HybridFlow-V (3/4)
    assert plan.redundancy_ratio == 1.0
