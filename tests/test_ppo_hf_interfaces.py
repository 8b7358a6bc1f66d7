"""PPO's model calls on HF checkpoints with variable-length prompts and EOS, against dense transformers.

The call functions the workers run (``common``) get this dp rank's rows of a batch of
prompts of 2..8 tokens, in three layouts on 2 gloo processes (dp=2, tp=2, pp=2). Their outputs must
equal what HF computes sequence by sequence, unpadded:
- greedy generation (top_k=1) token for token, stopping at the EOS id where HF does;
- the behaviour log-probs of sampled responses, the reference log-probs, the critic's values and the
  reward model's score at the last token, within 1e-4;
- the same rows in every layout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_helpers import build_model, tiny_hf_model
from mp_pool import GlooPool
from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import GENERATE, INFERENCE, ModelFunctionCallDef
from realloc.models.hf_io import model_config_from_hf

P, T, N = 8, 10, 6
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (dp, tp, pp)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    actor_dir = tmp_path_factory.mktemp("actor")
    critic_dir = tmp_path_factory.mktemp("critic")
    actor = tiny_hf_model(actor_dir, seed=0, kv_heads=2)
    critic = tiny_hf_model(critic_dir, seed=1, kv_heads=2, critic=True)
    return actor, actor_dir, critic, critic_dir


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([2, 8, 5, 3, 7, 4])
    tokens = torch.zeros(N, P, dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        tokens[b, :n] = torch.randint(1, 128, (n,), generator=g)
    return tokens, lens


def _ctx(model, call, ppo, ids, eos, n_mbs=2):
    from realloc.algorithms.context import CallContext

    return CallContext(call=call, model=model, optimizer=None, config=ppo, prompt_len=P, gen_len=T, seed=7,
                       iteration=0, ids=ids, batch_size=N, n_mbs=n_mbs, eos_token_ids=eos, pad_token_id=0)


def _run_calls(ctx, actor_dir, critic_dir, dp, tp, pp, eos, greedy_ppo, sampled_ppo):
    from realloc.algorithms import common as impls
    from realloc.strategy import even_ranges

    actor_cfg = model_config_from_hf(str(actor_dir))
    critic_cfg = model_config_from_hf(str(critic_dir))
    actor = build_model(ctx, actor_cfg, dp, tp, pp, hf_path=str(actor_dir))
    critic = build_model(ctx, critic_cfg, dp, tp, pp, hf_path=str(critic_dir))
    dp_rank = actor.groups.dp_rank
    lo, hi = even_ranges(N, dp)[dp_rank]
    ids = range(lo, hi)
    tokens, lens = _prompts()
    prompts = {"prompts": {"tokens": tokens[lo:hi], "lengths": lens[lo:hi]}}
    gen = ModelFunctionCallDef(name="gen", model_name="actor", interface_type=GENERATE, interface_impl="ppo_actor")
    inf = ModelFunctionCallDef(name="inf", model_name="actor", interface_type=INFERENCE, interface_impl="ppo_actor")
    out = {"rows": (lo, hi)}
    greedy = impls.actor_generate(_ctx(actor, gen, greedy_ppo, ids, eos), prompts).outputs
    out["greedy"] = greedy["seq"]
    sampled = impls.actor_generate(_ctx(actor, gen, sampled_ppo, ids, eos), prompts).outputs
    out["sampled"], out["gen_logp"] = sampled["seq"], sampled["logp"]["logp"]
    seq = {"seq": sampled["seq"]}
    last = actor.groups.is_last_stage and actor.groups.tp_rank == 0
    res = impls.actor_logprobs(_ctx(actor, inf, sampled_ppo, ids, eos, n_mbs=3), seq).outputs
    out["logp"] = res["logp"]["logp"] if last else None
    res = impls.critic_values(_ctx(critic, inf, sampled_ppo, ids, eos), seq).outputs
    out["values"] = res["values"]["values"] if last else None
    res = impls.model_reward(_ctx(critic, inf, sampled_ppo, ids, eos), seq).outputs
    out["score"] = res["rewards"]["score"] if last else None
    return out


def _gather(results, name):
    """Rows of every dp rank, from a rank that holds the key (the last stage's tp rank 0)."""
    rows = {}
    for r in results:
        if r[name] is not None:
            rows[r["rows"]] = r[name]
    parts = [rows[k] for k in sorted(rows)]
    if isinstance(parts[0], dict):
        return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
    return torch.cat(parts)


def _hf_greedy_eos(hf) -> int:
    """An EOS id that greedy decoding of these prompts emits early for some rows, so rows stop at different steps."""
    tokens, lens = _prompts()
    counts: dict[int, int] = {}
    for b in range(N):
        ids = tokens[b:b + 1, :lens[b]]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=T, do_sample=False,
                          pad_token_id=0)[0, lens[b]:]
        for t in out.tolist()[1:T // 2]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def test_ppo_calls_match_transformers_in_every_layout(pool, models):
    actor_hf, actor_dir, critic_hf, critic_dir = models
    eos = _hf_greedy_eos(actor_hf)
    greedy_ppo = PPOConfig(top_k=1)
    sampled_ppo = PPOConfig(temperature=0.9)
    tokens, lens = _prompts()
    per_layout = []
    for dp, tp, pp in LAYOUTS:
        res = pool.run(_run_calls, str(actor_dir), str(critic_dir), dp, tp, pp, (eos,), greedy_ppo, sampled_ppo)
        per_layout.append({k: _gather(res, k) for k in ("greedy", "sampled", "gen_logp", "logp", "values", "score")})

    ref = per_layout[0]
    stopped = 0
    for b in range(N):
        p = int(lens[b])
        ids = tokens[b:b + 1, :p]
        want = actor_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=T, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0)[0].tolist()
        g = ref["greedy"]
        n = int(g["gen_mask"][b].sum())
        assert int(g["prompt_lens"][b]) == p
        assert g["tokens"][b, :p + n].tolist() == want, b
        assert (g["tokens"][b, p + n:] == 0).all()
        stopped += n < T
    assert stopped >= 1, "no row stopped at EOS: the test would not exercise early stopping"

    s = ref["sampled"]
    for b in range(N):
        p, n = int(s["prompt_lens"][b]), int(s["gen_mask"][b].sum())
        seq = s["tokens"][b:b + 1, :p + n]
        with torch.no_grad():
            logits = actor_hf(input_ids=seq).logits[0].float()
            lp = torch.log_softmax(logits / 0.9, -1)[p - 1:p + n - 1].gather(-1, seq[0, p:, None])[:, 0]
            values = critic_hf.model(input_ids=seq).last_hidden_state
            values = critic_hf.score(values)[0, :, 0]
            score = critic_hf(input_ids=seq).logits[0, 0]
        torch.testing.assert_close(ref["gen_logp"][b, :n], lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(ref["logp"][b, :n], lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(ref["values"][b, :n], values[p - 1:p + n - 1], atol=1e-4, rtol=0)
        assert float(ref["score"][b]) == pytest.approx(float(score), abs=1e-4)
        for key in ("gen_logp", "logp", "values"):
            assert (ref[key][b, n:] == 0).all(), key
        if n < T:
            assert int(seq[0, -1]) == eos

    for other in per_layout[1:]:
        for k in ("greedy", "sampled"):
            for name in ref[k]:
                assert torch.equal(other[k][name], ref[k][name]), (k, name)
        for k in ("gen_logp", "logp", "values", "score"):
            torch.testing.assert_close(other[k], ref[k], atol=1e-5, rtol=0)


def _greedy_groups(pctx, actor_dir, dp, pp, eos, group):
    from realloc.algorithms import common as impls
    from realloc.strategy import even_ranges

    actor = build_model(pctx, model_config_from_hf(str(actor_dir)), dp, 1, pp, hf_path=str(actor_dir))
    lo, hi = even_ranges(N * group, dp)[actor.groups.dp_rank]
    tokens, lens = (t.repeat_interleave(group, dim=0)[lo:hi] for t in _prompts())
    decoded: list[int] = []  # prompts per generate() call: the engine's real decoding, counted
    generate = actor.generate

    def counted(prompts, *args, **kw):
        decoded.append(len(prompts))
        return generate(prompts, *args, **kw)

    actor.generate = counted
    gen = ModelFunctionCallDef(name="gen", model_name="actor", interface_type=GENERATE, interface_impl="ppo_actor",
                               n_samples=group)
    cctx = dataclasses.replace(_ctx(actor, gen, PPOConfig(), range(lo, hi), eos), greedy=True, group_size=group,
                               batch_size=N * group, purpose="eval0")
    out = impls.actor_generate(cctx, {"prompts": {"tokens": tokens, "lengths": lens}}).outputs
    return {"rows": (lo, hi), "greedy": out["seq"], "decoded": decoded}


def test_greedy_evaluation_decodes_each_prompt_of_a_group_once(pool, models):
    """Greedy evaluation of a group-sampling run: the n copies of a prompt get transformers' greedy answer, and
    the engine decodes each distinct prompt once (it used to decode every copy)."""
    actor_hf, actor_dir, _, _ = models
    eos, group = _hf_greedy_eos(actor_hf), 3
    tokens, lens = _prompts()
    want = []
    for b in range(N):
        ids = tokens[b:b + 1, :lens[b]]
        want.append(actor_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=T, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0)[0].tolist())
    for dp, pp in ((2, 1), (1, 2)):
        res = pool.run(_greedy_groups, str(actor_dir), dp, pp, (eos,), group)
        assert [r["decoded"] for r in res] == ([[N // 2]] * 2 if dp == 2 else [[N]] * 2), (dp, pp)
        g = _gather(res, "greedy")
        for row in range(N * group):
            b = row // group
            n = int(g["gen_mask"][row].sum())
            assert g["tokens"][row, :int(lens[b]) + n].tolist() == want[b], (dp, pp, row)


def test_rule_reward_sees_prompt_and_response_split_per_row():
    from realloc.algorithms.rewards.rule_reward import split_prompt_response

    tokens = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [5, 1, 2, 3, 0, 0, 0]])
    seq = {"tokens": tokens, "prompt_lens": torch.tensor([2, 1]),
           "gen_mask": torch.tensor([[True, True, True, False], [True, True, True, False]])}
    prompt, response = split_prompt_response(seq, pad_token_id=0)
    assert prompt.tolist() == [[5, 6, 0], [5, 0, 0]]
    assert response.tolist() == [[7, 8, 9, 0], [1, 2, 3, 0]]


def test_response_columns_shift():
    from realloc.algorithms.common import response_columns

    per_pos = torch.arange(12, dtype=torch.float32).view(2, 6)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = response_columns(per_pos, torch.tensor([2, 4]), mask)
    assert got.tolist() == [[2.0, 3.0, 0.0], [10.0, 0.0, 0.0]]
    got = response_columns(per_pos, torch.tensor([2, 4]), mask, shift=-1)
    assert got.tolist() == [[1.0, 2.0, 0.0], [9.0, 0.0, 0.0]]


def test_generation_config_carries_eos_and_pad():
    from realloc.algorithms.common import generation_config

    call = ModelFunctionCallDef(name="gen", model_name="actor", interface_type=GENERATE)
    ctx = _ctx(None, call, PPOConfig(), range(0, 2), (3, 9))
    ctx = dataclasses.replace(ctx, pad_token_id=2)
    g = generation_config(ctx)
    assert g.eos_token_ids == (3, 9) and g.pad_token_id == 2 and g.max_new_tokens == T
