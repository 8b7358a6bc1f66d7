"""One tp rule for the planner and the model (issue 15 item 8), and the price of replicated KV heads.

The model side is checked by building ``LlamaStage`` for every tp rank of every tp the
planner considers, on a stand-in tp group (no processes): whatever the planner offers
must build with the shards ``param_layout`` describes, and whatever it refuses the model
refuses with the same reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from realloc.api import GENERATE, TRAIN_STEP
from realloc.cluster import ClusterSpec
from realloc.estimator.call_time import CallTimer
from realloc.estimator.comm import CommModel, group_links
from realloc.estimator.memory import Workload, stage_call_memory
from realloc.estimator.roofline import RooflineCosts
from realloc.models.config import ModelConfig, tp_error
from realloc.models.param_layout import stage_param_specs
from realloc.strategy import ParallelStrategy as S
from realloc.strategy import divisors, enumerate_strategies, strategy_error


class StandInGroup:
    """What megatron's layers ask a tp group while building: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def build_stage(cfg: ModelConfig, tp: int, tp_rank: int, pp: int, pp_rank: int, monkeypatch) -> dict:
    from realloc.models.llama import LlamaStage

    # megatron reads group sizes only once torch.distributed is up; the stand-in group answers them
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    stage = LlamaStage(cfg, pp, pp_rank, StandInGroup(tp, tp_rank))
    return {n: tuple(p.shape) for n, p in stage.named_parameters()}


H = 64
ODD = [
    # (config, devices, tp offered): vocab 100 is not split 8 ways but padded to 104 (issue 11), 2 KV heads
    # are replicated at tp=4 and 8
    (ModelConfig("odd-vocab", 100, H, 176, 2, 8, 2), 8, {1, 2, 4, 8}),
    (dataclasses.replace(ModelConfig("odd-vocab", 100, H, 176, 2, 8, 2), is_critic=True, name="odd-critic"), 8,
     {1, 2, 4, 8}),
    # 8 KV heads: before the one rule the planner offered tp=8 here and the model refused it
    (ModelConfig("odd-vocab-mha", 100, H, 176, 2, 8, 8), 8, {1, 2, 4, 8}),
    # MLP 180 is not split 8 ways; 1 KV head with q/k/v biases
    (ModelConfig("odd-mlp", 64, H, 180, 2, 8, 1, family="qwen2", qkv_bias=True), 8, {1, 2, 4}),
    # 3 KV heads of 6: tp=2 neither divides nor is a multiple of them, tp=6 replicates them
    (ModelConfig("odd-kv", 96, 96, 192, 2, 6, 3), 6, {1, 3, 6}),
]


@pytest.mark.parametrize("cfg,world,offered_tp", ODD, ids=[c.name for c, _, _ in ODD])
def test_every_strategy_the_planner_offers_builds_and_every_other_is_refused(cfg, world, offered_tp, monkeypatch):
    offered = {s.tp for s in enumerate_strategies(cfg, world, world, world)}
    for tp in divisors(world):
        err = tp_error(cfg, tp)
        assert (tp in offered) == (err is None), (cfg.name, tp, err)
        assert strategy_error(cfg, S(world // tp, tp, 1), world) == err
        if err is not None:
            with pytest.raises(ValueError, match=err.replace("(", r"\(").replace(")", r"\)")):
                build_stage(cfg, tp, 0, 1, 0, monkeypatch)
            continue
        for pp in (1, 2):
            for pp_rank in range(pp):
                want = {s.name: s.shard_shape(tp) for s in stage_param_specs(cfg, pp, pp_rank)}
                for tp_rank in range(tp):
                    assert build_stage(cfg, tp, tp_rank, pp, pp_rank, monkeypatch) == want
    assert offered == offered_tp


# 8 heads of width 16, so tp=8 needs KV heads replicated when there are fewer than 8.
def kv_model(n_kv: int) -> ModelConfig:
    return ModelConfig(f"kv{n_kv}", 256, 128, 384, 4, 8, n_kv)


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_planner_offers_tp8_and_prices_replicated_kv_heads_by_hand(n_kv):
    cfg = kv_model(n_kv)
    assert 8 in {s.tp for s in enumerate_strategies(cfg, 8, 8, 16)}
    V, Hd, I, L, hd = 256, 128, 384, 4, 16
    cluster = ClusterSpec.from_nodelist("n1", 8)
    hw = cluster.hardware
    prec = hw.precision
    s = S(1, 8, 1)
    # parameters per device at tp=8: an eighth of q, o, MLP, embedding and LM head, whole norms,
    # and one whole KV head of k and v (shared with 8 / n_kv - 1 other ranks)
    layer = 2 * Hd * Hd // 8 + 2 * hd * Hd + 3 * Hd * I // 8 + 2 * Hd
    params = V * Hd // 8 + L * layer + Hd + V * Hd // 8
    work = Workload(GENERATE, n_seqs=16, n_steps=1, prompt_len=8, gen_len=8)
    mem = stage_call_memory(cfg, work, s, 2, 0, prec)
    assert mem.params == params * prec.param
    # KV cache: 8 sequences per micro-batch x 16 positions x 4 layers x K and V of one head
    assert mem.kv_cache == 8 * 16 * L * 2 * hd * prec.param
    # at tp=2 the KV heads are split (or whole when n_kv = 1)
    assert stage_call_memory(cfg, work, S(4, 2, 1), 2, 0, prec).kv_cache == 2 * 16 * L * 2 * max(1, n_kv // 2) * hd * \
        prec.param
    train = stage_call_memory(cfg, Workload(TRAIN_STEP, 16, 1, 8, 8), s, 1, 0, prec)
    assert train.grads == params * prec.grad and train.optimizer == params * prec.optimizer
    # the train step's extra all-reduce: every layer's k and v gradient among the 8 / n_kv ranks sharing it
    comm = CommModel(cluster)
    timer = CallTimer(cfg, RooflineCosts(cfg, hw, comm), comm, hw)
    group, nbytes = 8 // n_kv, L * 2 * hd * Hd * prec.grad
    bw = cluster.intra_node_bandwidth * hw.comm_efficiency
    step = timer._optimizer_step(s, group_links((1, 8), s))
    assert step.tp_comm == pytest.approx(hw.intra_node_latency + 2 * (group - 1) / group * nbytes / bw)
    split = S(8 // n_kv, n_kv, 1)  # tp = n_kv: heads split, nothing to sum
    assert timer._optimizer_step(split, group_links((1, 8), split)).tp_comm == 0.0


def test_vocabulary_padding_by_hand():
    """The padded vocabulary is the smallest multiple of gcd(heads, MLP width) (every legal tp divides it);
    registry models are unchanged; counts reported to users stay the checkpoint's, the engine's add the rows."""
    from realloc.models.config import get_model_config
    from realloc.models.param_layout import param_specs

    llama2_pad = ModelConfig("llama2-7b-pad", 32001, 4096, 11008, 32, 32, 32)  # LLaMA-2 + a pad token
    gpt2_like = ModelConfig("gpt2-like", 50257, 768, 3072, 12, 12, 12)
    assert (llama2_pad.vocab_multiple, llama2_pad.padded_vocab_size) == (32, 32032)
    assert (gpt2_like.vocab_multiple, gpt2_like.padded_vocab_size) == (12, 50268)  # 4189 x 12
    for name in ("tiny", "tiny-gqa", "small", "llama2-7b", "llama2-70b", "llama3-8b", "llama3-13b", "llama3-70b"):
        cfg = get_model_config(name)
        assert cfg.vocab_padding == 0 and cfg.allocated_params == cfg.total_params, name
    cfg = ModelConfig("v97", 97, 128, 384, 4, 8, 2)
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    for c, tables in ((cfg, 2), (tied, 1), (cfg.as_critic(), 1)):  # a critic pads its embedding only
        specs = param_specs(c)
        assert c.allocated_params == c.total_params + tables * 7 * 128
        assert sum(s.numel for s in specs) == c.allocated_params and sum(s.hf_numel for s in specs) == c.total_params
    emb = param_specs(cfg)[0]
    assert (emb.shape, emb.hf_shape) == ((104, 128), (97, 128))
    # tp=8: shards of 13 rows; the last holds 91..103, of which 91..96 are real
    assert [emb.real_rows(8, r) for r in range(8)] == [13] * 7 + [6]
    assert [emb.real_rows(4, r) for r in range(4)] == [26, 26, 26, 19]


def test_planner_offers_every_tp_for_a_vocabulary_of_97_and_prices_the_padding_by_hand():
    """Before vocabulary padding tp had to divide 97, so only tp=1 was offered (issue 11)."""
    from realloc.estimator import opcount as oc
    from realloc.models.hf_io import model_config_from_hf

    cfg = model_config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97,
                                "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
                                "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
                                "max_position_embeddings": 64, "tie_word_embeddings": False}, "v97")
    assert cfg.vocab_size == 97 and cfg.padded_vocab_size == 104
    assert {s.tp for s in enumerate_strategies(cfg, 8, 8, 16)} == {1, 2, 4, 8}
    V, Vp, Hd, I, L, hd = 97, 104, 128, 384, 4, 16
    assert cfg.total_params == V * Hd + L * (2 * Hd * Hd + 2 * 32 * Hd + 3 * Hd * I + 2 * Hd) + Hd + V * Hd
    prec = ClusterSpec.from_nodelist("n1", 8).hardware.precision
    # a device at tp=8: 13 rows of the embedding and of the LM head (104 / 8), an eighth of q, o and MLP,
    # one whole KV head of k and v (2 KV heads replicated 4x), whole norms
    layer = 2 * Hd * Hd // 8 + 2 * hd * Hd + 3 * Hd * I // 8 + 2 * Hd
    params = 13 * Hd + L * layer + Hd + 13 * Hd
    for work in (Workload(GENERATE, 16, 1, 8, 8), Workload(TRAIN_STEP, 16, 1, 8, 8)):
        mem = stage_call_memory(cfg, work, S(1, 8, 1), 1, 0, prec)
        assert mem.params == params * prec.param
    assert mem.grads == params * prec.grad and mem.optimizer == params * prec.optimizer
    # the head computes and keeps the padded shard's logits: 13 columns per token at tp=8, 26 at tp=4
    n = 4 * 16
    assert oc.op_work(cfg, oc.Part.HEAD, oc.Phase.FWD, 8, 4, 16, prec).gemm_flops == 2 * n * Hd * 13
    assert oc.op_work(cfg, oc.Part.HEAD, oc.Phase.FWD, 4, 4, 16, prec).gemm_flops == 2 * n * Hd * 26
    # the head keeps the final norm (the rank's 1/8 of the tokens, sequence parallel) and, of the chunked
    # log-prob, the logits of its 13-entry shard, the int64 target and fp32 log Z of every token
    assert oc.head_saved_bytes_per_token(cfg, 8, prec) == oc.norm_saved_bytes_per_token(cfg, prec, 8) + \
        13 * prec.param + 8 + 4
    # sampling: the gathered logits are padded, the rest of the sampler sees the real vocabulary
    assert oc.sampling_bytes_per_row(cfg) == 4 * Vp + 30 * V
