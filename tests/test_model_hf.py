"""The parallel model against HuggingFace transformers: logits, greedy decoding, critic values, checkpoint I/O.

Tiny random LlamaForCausalLM and Qwen2ForCausalLM models (Qwen2 with random q/k/v
biases) are built locally with a seed and saved as safetensors (never downloaded),
loaded into (tp, pp) layouts on 4 gloo processes, and compared with the dense HF
model in the test process. Models with fewer KV heads than tp (1 KV head at tp=2
and 4, 2 KV heads at tp=4) exercise KV-head replication.
"""

from __future__ import annotations

import json

import pytest
import torch

from realloc.models.hf_io import model_config_from_hf
from realloc.models.sampling import GenerationConfig
from model_helpers import assemble, build_model, hf_token_logprobs, local_shards, tiny_hf_model
from mp_pool import GlooPool

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
REPLICATED = [(2, 1), (4, 1)]  # 1 KV head: each rank's head is shared by 2 and 4 ranks


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(WORLD, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_gqa")
    return tiny_hf_model(path, seed=0, kv_heads=2), path


@pytest.fixture(scope="module")
def tied_llama3(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tied")
    return tiny_hf_model(path, seed=1, kv_heads=4, tie=True, llama3_rope=True), path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen2")
    return tiny_hf_model(path, seed=5, family="qwen2", kv_heads=2), path


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen2_tied")
    return tiny_hf_model(path, seed=6, family="qwen2", kv_heads=2, tie=True), path


@pytest.fixture(scope="module")
def llama_mqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama_mqa")
    return tiny_hf_model(path, seed=7, kv_heads=1), path


@pytest.fixture(scope="module")
def qwen2_mqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_qwen2_mqa")
    return tiny_hf_model(path, seed=8, family="qwen2", kv_heads=1), path


def _padded_batch(seed: int = 0, lengths=(12, 7, 16, 3), vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), max(lengths)), generator=g)
    lens = torch.tensor(lengths)
    mask = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()
    return ids * mask, lens, mask


def _prompts(seed: int = 3, lengths=(3, 7, 5, 9), vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf, prompts, max_new: int, eos: int | None) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)
        out.append(seq[0].tolist())
    return out


def _run_hf_compare(ctx, cfg, tp, pp, path, ids, lens, prompts, gconfig):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path)
    if model is None:
        return None
    batch = {"input_ids": ids, "lengths": lens}
    logits = model.forward(batch, output="logits", n_mbs=2)
    logp = model.forward(batch, n_mbs=3, to_all_stages=True)
    entropy = model.forward(batch, output="entropy", n_mbs=2)
    gen = model.generate(prompts, gconfig)
    seqs = [gen.sequences[b, :gen.lengths[b]].tolist() for b in range(len(prompts))]
    # The same prompts as a right-padded batch, in two micro-batches: same tokens.
    padded = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = torch.tensor(p)
    again = model.generate({"input_ids": padded, "lengths": torch.tensor([len(p) for p in prompts])}, gconfig,
                           n_mbs=2)
    assert torch.equal(again.sequences, gen.sequences) and torch.equal(again.lengths, gen.lengths)
    return {"last": model.groups.is_last_stage, "logits": logits, "logp": logp, "entropy": entropy, "seqs": seqs,
            "gen_logp": gen.logprobs, "plen": gen.prompt_lengths, "eos": gen.stopped_at_eos}


def _hf_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] entropy of the distribution that predicted each token (the log-prob alignment), from HF logits."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    out = torch.zeros(mask.shape)
    out[:, 1:] = -(lp.exp() * lp).sum(-1) * (mask[:, 1:].bool() & mask[:, :-1].bool())
    return out


def _check_against_hf(pool, hf, path, layouts):
    cfg = model_config_from_hf(path)
    vocab = min(cfg.vocab_size, 128)
    ids, lens, mask = _padded_batch(vocab=vocab)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        ref_logits = hf_logits * mask[..., None]
        ref_logp = hf_token_logprobs(hf, ids, mask)
        ref_entropy = _hf_entropy(hf_logits, mask)
    assert ref_logits.shape[-1] == cfg.vocab_size
    prompts = _prompts(vocab=vocab)
    # EOS = a token HF emits mid-way for prompt 0, so stopping at EOS is exercised.
    eos = _hf_greedy(hf, prompts[:1], 10, None)[0][len(prompts[0]) + 3]
    ref_seqs = _hf_greedy(hf, prompts, 10, eos)
    gconfig = GenerationConfig(max_new_tokens=10, greedy=True, eos_token_ids=(eos,))
    for tp, pp in layouts:
        res = pool.run(_run_hf_compare, cfg, tp, pp, str(path), ids, lens, prompts, gconfig)
        for r in res[:tp * pp]:
            # Every rank of the replica gets log-probs (to_all_stages) and the generated sequences.
            assert torch.allclose(r["logp"], ref_logp, atol=1e-4), (tp, pp, (r["logp"] - ref_logp).abs().max())
            assert r["seqs"] == ref_seqs, (tp, pp, r["seqs"], ref_seqs)
            if r["last"]:
                # the real vocabulary's logits (padding rows cut), and the entropy over it alone
                assert r["logits"].shape == ref_logits.shape, (tp, pp, r["logits"].shape)
                err = (r["logits"] - ref_logits).abs().max().item()
                assert err < 1e-4, (tp, pp, err)
                assert torch.allclose(r["entropy"], ref_entropy, atol=1e-4), (tp, pp)
            else:
                assert r["logits"] is None
        assert any(r["eos"].any() for r in res[:tp * pp])
        # Generated log-probs equal a teacher-forced forward pass of HF over the generated sequences.
        r0 = res[0]
        for b, seq in enumerate(ref_seqs):
            t = torch.tensor([seq])
            ref = hf_token_logprobs(hf, t, torch.ones_like(t))[0]
            p = int(r0["plen"][b])
            assert torch.allclose(r0["gen_logp"][b, p:len(seq)], ref[p:], atol=1e-4)
            assert (r0["gen_logp"][b, :p] == 0).all()


@torch.no_grad()
def test_gqa_model_matches_hf_logits_and_greedy_in_every_layout(pool, gqa):
    hf, path = gqa
    # tp=4 with 2 KV heads: each KV head on 2 ranks
    _check_against_hf(pool, hf, path, LAYOUTS + [(4, 1)])


@pytest.mark.parametrize("which", ["qwen2", "qwen2_tied"])
@torch.no_grad()
def test_qwen2_matches_hf_logits_and_greedy_in_every_layout(pool, which, request):
    hf, path = request.getfixturevalue(which)
    cfg = model_config_from_hf(path)
    assert (cfg.family, cfg.qkv_bias, cfg.rope_theta, cfg.tie_embeddings) == ("qwen2", True, 1e6, which == "qwen2_tied")
    _check_against_hf(pool, hf, path, LAYOUTS)


@pytest.mark.parametrize("which", ["llama_mqa", "qwen2_mqa"])
@torch.no_grad()
def test_one_kv_head_replicated_over_tp_matches_hf(pool, which, request):
    hf, path = request.getfixturevalue(which)
    assert model_config_from_hf(path).n_kv_heads == 1
    _check_against_hf(pool, hf, path, REPLICATED)


@pytest.mark.parametrize("family,layouts", [("llama", [(1, 1), (2, 1), (2, 2)]), ("qwen2", [(2, 1)])])
@torch.no_grad()
def test_explicit_head_dim_matches_hf(pool, tmp_path, family, layouts):
    """head_dim 32 over a 64-wide model with 4 heads: q and o projections 128 wide (as in Gemma or Qwen3)."""
    from realloc.models.param_layout import param_specs

    hf = tiny_hf_model(tmp_path, seed=9, family=family, kv_heads=2, head_dim=32)
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    cfg = model_config_from_hf(tmp_path)
    assert (cfg.hidden_size, cfg.n_heads, cfg.head_dim, cfg.q_dim, cfg.kv_dim) == (64, 4, 32, 128, 64)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert cfg.total_params == n_hf == sum(s.numel for s in param_specs(cfg))
    _check_against_hf(pool, hf, tmp_path, layouts)


@pytest.mark.parametrize("family,vocab,tie,padded", [("llama", 97, False, 100), ("llama", 97, True, 100),
                                                    ("qwen2", 250, False, 252)])
@torch.no_grad()
def test_vocabulary_that_tp_does_not_divide_matches_hf(pool, tmp_path, family, vocab, tie, padded):
    """Issue 11: 97 and 250 tokens, split 2 and 4 ways by padding the engine's vocabulary to a multiple of 4
    (gcd of 4 heads and a 176-wide MLP). Logits, log-probs, entropies and greedy tokens equal HF's, whose
    vocabulary has no padding: the padding columns take no probability mass and are never generated."""
    hf = tiny_hf_model(tmp_path, seed=10, family=family, kv_heads=2, tie=tie, vocab=vocab)
    cfg = model_config_from_hf(tmp_path)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.tie_embeddings) == (vocab, padded, tie)
    _check_against_hf(pool, hf, tmp_path, [(1, 1), (2, 1), (4, 1), (2, 2)])
    # Near-uniform sampling without a tokenizer's vocab_limit: 240 draws reach the top real ids but never
    # the padding (which would take ~1-3% of them if it had any mass).
    prompts = _prompts(seed=11, lengths=(3, 7, 5, 9, 4, 6, 2, 8), vocab=vocab)
    hot = GenerationConfig(max_new_tokens=30, temperature=50.0, seed=5)
    seqs = pool.run(_sample_with_limits, cfg, 4, str(tmp_path), prompts, [hot])[0][0]
    drawn = torch.cat([seqs[b, len(p):len(p) + 30] for b, p in enumerate(prompts)])
    assert drawn.numel() == 240 and int(drawn.max()) < vocab and int(drawn.max()) >= vocab - 8


@torch.no_grad()
def test_tied_embeddings_with_llama3_rope_match_hf(pool, tied_llama3):
    hf, path = tied_llama3
    cfg = model_config_from_hf(path)
    assert cfg.tie_embeddings and cfg.rope_scaling == (8.0, 1.0, 4.0, 16)
    _check_against_hf(pool, hf, path, [(1, 1), (2, 2)])


def _critic_values(ctx, cfg, tp, pp, path, ids, lens):
    model = build_model(ctx, cfg, 1, tp, pp, hf_path=path)
    if model is None:
        return None
    return model.forward({"input_ids": ids, "lengths": lens}, n_mbs=2)


@pytest.mark.parametrize("family,layouts,vocab", [("llama", [(1, 1), (2, 2)], 128), ("qwen2", [(2, 2), (4, 1)], 128),
                                                  ("llama", [(4, 1)], 97)])  # embedding padded to 100 rows
@torch.no_grad()
def test_critic_values_match_hf_sequence_classifier(pool, tmp_path, family, layouts, vocab):
    hf = tiny_hf_model(tmp_path, seed=2, critic=True, family=family, vocab=vocab)
    cfg = model_config_from_hf(tmp_path)
    assert cfg.is_critic and cfg.family == family and cfg.vocab_size == vocab
    ids, lens, mask = _padded_batch(seed=5, vocab=vocab)
    ref = hf.score(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0] * mask
    # HF's own pooled output is the value at each row's last token.
    pooled = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    last_token = torch.arange(len(lens)), lens - 1
    assert torch.allclose(pooled, ref[last_token], atol=1e-5)
    for tp, pp in layouts:
        res = pool.run(_critic_values, cfg, tp, pp, str(tmp_path), ids, lens)
        last = res[tp * pp - 1]
        assert torch.allclose(last, ref, atol=1e-4), (tp, pp, (last - ref).abs().max())
        assert torch.allclose(last[last_token], pooled, atol=1e-4)


def _save(ctx, cfg, dp, tp, pp, src, dst, max_file_bytes):
    from realloc.models.hf_io import save_hf_checkpoint

    model = build_model(ctx, cfg, dp, tp, pp, hf_path=src)
    if model is not None:
        save_hf_checkpoint(model, dst, max_file_bytes=max_file_bytes, hf_extra={"bos_token_id": 1})
    return local_shards(model)


def _load(ctx, cfg, dp, tp, pp, path):
    return local_shards(build_model(ctx, cfg, dp, tp, pp, hf_path=path))


@pytest.mark.parametrize("which,tp,pp", [("gqa", 2, 2), ("qwen2_tied", 2, 2), ("qwen2_mqa", 4, 1)])
@torch.no_grad()
def test_save_reload_dense_and_into_hf(pool, which, tp, pp, tmp_path, request):
    """Load from HF into (tp, pp), save, and compare the files with HF's own weights; reload both ways.
    With 1 KV head at tp=4 every rank reads the same k/v slice and the save writes it once."""
    from transformers import AutoModelForCausalLM

    hf, src = request.getfixturevalue(which)
    cfg = model_config_from_hf(src)
    saved = assemble(pool.run(_save, cfg, 1, tp, pp, str(src), str(tmp_path / "a"), 4 << 30), cfg)
    # One file per stage when pp=2 gathers nothing across stages, plus an index.
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == (["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                      "model-00002-of-00002.safetensors", "model.safetensors.index.json"] if pp == 2
                     else ["config.json", "generation_config.json", "model.safetensors"])
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["architectures"] == [type(hf).__name__]
    hf_state = hf.state_dict()
    for name, t in saved.items():
        assert torch.equal(t, hf_state[name]), name
    reloaded = assemble(pool.run(_load, cfg, 1, 1, 1, str(tmp_path / "a")), cfg)
    for name, t in reloaded.items():
        assert torch.equal(t, hf_state[name]), name
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids, lens, mask = _padded_batch(seed=9)
    assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits)


@torch.no_grad()
def test_save_carries_special_token_ids(pool, gqa, tmp_path):
    """LLaMA-3-style ids (no pad, several EOS in generation_config.json) survive load -> tp=2 -> save -> transformers;
    transformers' defaults (bos 1, eos 2) would be wrong."""
    import shutil

    from transformers import AutoModelForCausalLM, GenerationConfig as HFGenerationConfig

    _, src = gqa
    mine = tmp_path / "src"
    shutil.copytree(src, mine)
    config = json.loads((mine / "config.json").read_text())
    config.update(bos_token_id=120, eos_token_id=121, pad_token_id=None)
    (mine / "config.json").write_text(json.dumps(config))
    (mine / "generation_config.json").write_text(json.dumps({"bos_token_id": 120, "eos_token_id": [121, 125]}))
    cfg = model_config_from_hf(mine)
    assert dict(cfg.special_tokens) == {"bos_token_id": 120, "eos_token_id": (121, 125)}
    pool.run(_save_plain, cfg, str(mine), str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    gen = HFGenerationConfig.from_pretrained(tmp_path / "out")
    assert back.config.bos_token_id == 120 and gen.bos_token_id == 120 and gen.eos_token_id == [121, 125]
    assert dict(model_config_from_hf(tmp_path / "out").special_tokens) == dict(cfg.special_tokens)


def _save_plain(ctx, cfg, src, dst):
    from realloc.models.hf_io import save_hf_checkpoint

    model = build_model(ctx, cfg, 1, 2, 1, hf_path=src)
    if model is not None:
        save_hf_checkpoint(model, dst)


@torch.no_grad()
def test_sharded_checkpoint_with_index_loads_into_dp2_tp2(pool, tied_llama3, tmp_path):
    hf, src = tied_llama3
    cfg = model_config_from_hf(src)
    # ~40 KB files: many shards per stage, an index, and a tied model without lm_head.
    pool.run(_save, cfg, 2, 1, 2, str(src), str(tmp_path / "s"), 40_000)  # dp=2: replica 0 writes
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 4 and "lm_head.weight" not in index["weight_map"]
    res = pool.run(_load, cfg, 2, 2, 1, str(tmp_path / "s"))
    hf_state = hf.state_dict()
    for d in (0, 1):
        replica = [dict(r, dp=0) for r in res if r["dp"] == d]
        for name, t in assemble(replica, cfg).items():
            assert torch.equal(t, hf_state[name]), (d, name)


def _critic_from_actor(ctx, cfg, path, seed):
    from realloc.models.hf_io import load_hf_checkpoint

    model = build_model(ctx, cfg, 1, 2, 1)
    if model is None:
        return None
    try:
        load_hf_checkpoint(model, path)
        return "no error"
    except ValueError as e:
        msg = str(e)
    load_hf_checkpoint(model, path, score_init_seed=seed)
    return msg, local_shards(model)


def test_critic_from_causal_lm_checkpoint_needs_a_score_seed(pool, gqa):
    from realloc.models.weights import init_full_tensor
    from realloc.models.param_layout import param_specs

    hf, src = gqa
    cfg = model_config_from_hf(src, critic=True)
    res = pool.run(_critic_from_actor, cfg, str(src), 7)
    msg, _ = res[0]
    assert "score_init_seed" in msg
    full = assemble([r[1] for r in res[:2]], cfg)
    score_spec = next(s for s in param_specs(cfg) if s.name == "score.weight")
    assert torch.equal(full["score.weight"], init_full_tensor(score_spec, 7))
    # The trunk is the actor's, weight for weight; only the output layer differs (lm_head -> fresh score).
    hf_state = hf.state_dict()
    assert set(full) - {"score.weight"} == set(hf_state) - {"lm_head.weight"}
    for name, t in full.items():
        if name != "score.weight":
            assert torch.equal(t, hf_state[name]), name
    assert torch.equal(full["model.layers.3.mlp.down_proj.weight"], hf.state_dict()["model.layers.3.mlp.down_proj.weight"])


def _sample_with_limits(ctx, cfg, tp, path, prompts, configs):
    model = build_model(ctx, cfg, 1, tp, 1, hf_path=path)
    if model is None:
        return None
    return [model.generate(prompts, g, seq_ids=list(range(len(prompts)))).sequences for g in configs]


@torch.no_grad()
def test_sampling_never_emits_ids_past_the_tokenizer_in_any_tp(pool, gqa):
    """A checkpoint's vocabulary (128 rows) padded past its tokenizer's (100 tokens): sampling at temperature 1
    without top-k picks padding ids unless limited; with the limit it never does, and tp=1 and tp=2 (vocabulary
    shards of 64 rows, the limit cutting inside the second) draw the same tokens."""
    _, path = gqa
    cfg = model_config_from_hf(path)
    prompts = _prompts(seed=11, lengths=(3, 7, 5, 9, 4, 6, 2, 8))
    free = GenerationConfig(max_new_tokens=12, temperature=1.5, seed=5)
    limited = GenerationConfig(max_new_tokens=12, temperature=1.5, seed=5, vocab_limit=100)
    out = {tp: pool.run(_sample_with_limits, cfg, tp, str(path), prompts, [free, limited])[0] for tp in (1, 2)}
    for tp, (unlimited, capped) in out.items():
        # no EOS: every row generates 12 tokens after its prompt
        assert max(int(capped[b, len(p):].max()) for b, p in enumerate(prompts)) < 100, tp
        assert max(int(unlimited[b, len(p):].max()) for b, p in enumerate(prompts)) >= 100, tp  # the limit matters
    assert torch.equal(out[1][1], out[2][1]) and torch.equal(out[1][0], out[2][0])
