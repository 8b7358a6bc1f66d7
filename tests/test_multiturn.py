"""Multi-turn rollouts (realloc/algorithms/multiturn.py) on real gloo ranks with a tiny random model.

A rollout's response is the policy's turns and the environment's observations in one sequence; ``loss_mask``
marks the policy's tokens. Checked against independent references: the environment replayed on the decoded policy
turns gives back the observation tokens and the rewards; a teacher-forced forward pass gives back the sampled
log-probs on the policy's tokens; each policy-gradient train step's gradient with respect to the log-prob of every
environment token is exactly zero; and the same rollouts come out under four layouts.
"""

from __future__ import annotations

import pytest
import torch

from mp_pool import GlooPool
from model_helpers import build_model
from multiturn_cases import CHARACTERS, LengthEnv

P, T, N, GROUP = 3, 40, 4, 2
ENV = {"env": "multiturn_cases:make_env", "env_args": {"turns": 3, "tool": True}, "max_turns": 3, "turn_tokens": 8}
PROMPTS = [[1, 10, 11], [1, 12], [1, 10, 11], [1, 12]]  # BOS + digits; two groups of two responses
ANSWERS = ["7", "42"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from realloc.demo.arith_task import train_tokenizer

    return str(train_tokenizer(tmp_path_factory.mktemp("tok"), CHARACTERS))


def _ctx(model, tok, call, lo: int, hi: int, cfg):
    from realloc.algorithms.context import CallContext

    return CallContext(call=call, model=model, optimizer=None, config=cfg, prompt_len=P, gen_len=T, seed=11,
                       iteration=0, ids=range(lo, hi), batch_size=N, n_mbs=2 if hi - lo > 1 else 1,
                       eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id, vocab_limit=tok.vocab_size,
                       group_size=GROUP, tokenizer=tok, records=lambda row: {"answer": ANSWERS[row]})


def _prompts(lo: int, hi: int) -> dict[str, torch.Tensor]:
    tokens = torch.zeros(N, P, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        tokens[b, :len(p)] = torch.tensor(p)
    return {"tokens": tokens[lo:hi], "lengths": torch.tensor([len(p) for p in PROMPTS])[lo:hi],
            "rows": torch.tensor([b // GROUP for b in range(N)])[lo:hi]}


def _generate(ctx, tokenizer_dir: str, dp: int, tp: int, pp: int, env: dict = ENV, cfg=None):
    from realloc.algorithms.critic_free.grpo import GRPOConfig
    from realloc.algorithms.critic_free.multiturn import multiturn_generate
    from realloc.calls import GENERATE, ModelFunctionCallDef
    from realloc.data.tokenizer import Tokenizer
    from realloc.models.config import get_model_config

    model = build_model(ctx, cfg or get_model_config("tiny"), dp, tp, pp, seed=5)
    if model is None:
        return None
    tok = Tokenizer.load(tokenizer_dir)
    call = ModelFunctionCallDef(name="actor_gen", model_name="actor", interface_type=GENERATE,
                                interface_impl="grpo_multiturn", interface_args=env)
    n = N // dp
    lo = model.groups.dp_rank * n
    out = multiturn_generate(_ctx(model, tok, call, lo, lo + n, GRPOConfig()), {"prompts": _prompts(lo, lo + n)})
    reporter = model.groups.tp_rank == 0 and model.groups.is_last_stage
    with torch.no_grad():
        seq = out.outputs["seq"]
        from realloc.algorithms.common import forward_batch, response_columns
        lp = model.forward(forward_batch(seq), n_mbs=1, output="logprobs")
        forced = None if lp is None else response_columns(lp.cpu(), seq["prompt_lens"], seq["gen_mask"])
    return {"dp": model.groups.dp_rank, "reporter": reporter, "outputs": out.outputs, "sums": out.sums,
            "forced": forced}


def _gathered(results) -> dict:
    """The reporting ranks' outputs, in dp order, concatenated."""
    parts = sorted((r for r in results if r is not None and r["reporter"]), key=lambda r: r["dp"])
    cat = {k: torch.cat([p["outputs"]["seq"][k] for p in parts]) for k in ("tokens", "gen_mask", "loss_mask")}
    cat["logp"] = torch.cat([p["outputs"]["logp"]["logp"] for p in parts])
    cat["score"] = torch.cat([p["outputs"]["rewards"]["score"] for p in parts])
    cat["forced"] = torch.cat([p["forced"] for p in parts])
    cat["sums"] = [p["sums"] for p in parts]
    return cat


@pytest.fixture(scope="module")
def single(pool, tokenizer_dir):
    return _gathered(pool.run(_generate, tokenizer_dir, 1, 1, 1))


def _runs(tokens: list[int], policy: list[bool]) -> list[tuple[bool, list[int]]]:
    out: list[tuple[bool, list[int]]] = []
    for t, p in zip(tokens, policy):
        if out and out[-1][0] == p:
            out[-1][1].append(t)
        else:
            out.append((p, [t]))
    return out


def test_environment_tokens_and_rewards_are_the_environment_replayed_on_the_policy_turns(single, tokenizer_dir):
    from realloc.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    for b in range(N):
        k = int(single["gen_mask"][b].sum())
        plen = len(PROMPTS[b])
        assert single["tokens"][b, :plen].tolist() == PROMPTS[b]
        runs = _runs(single["tokens"][b, plen:plen + k].tolist(), single["loss_mask"][b, :k].tolist())
        env = LengthEnv(turns=3)  # the same environment, without the tool: the calculator's n*1 is n
        assert runs[0] == (False, tok.encode(env.reset({"answer": ANSWERS[b // GROUP]}), add_special_tokens=False))
        reward, turns = 0.0, [r for p, r in runs if p]
        for i, (is_policy, toks) in enumerate(runs[1:]):
            if not is_policy:
                continue
            obs, r, done = env.step(tok.decode(toks))
            reward += r
            nxt = runs[2 + i] if 2 + i < len(runs) else None
            if done:
                assert nxt is None
            elif nxt is not None:
                assert nxt == (False, tok.encode(obs, add_special_tokens=False)[:len(nxt[1])])
        assert len(turns) == 3 or k == T  # three turns, or the budget ran out first
        assert float(single["score"][b]) == pytest.approx(reward)
        assert single["loss_mask"][b, k:].sum() == 0 and not single["gen_mask"][b, k:].any()
    assert single["sums"][0]["tool_ok"] > 0 and single["sums"][0].get("tool_error", 0) == 0


def test_trained_tokens_are_the_sampled_ones_with_their_log_probs(single):
    mask, gen = single["loss_mask"], single["gen_mask"]
    assert (mask & ~gen).sum() == 0 and mask.sum() > 0 and (gen & ~mask).sum() > 0
    # on the policy's tokens the sampling log-probs are the teacher-forced ones; elsewhere 0, never used
    torch.testing.assert_close(single["logp"][mask], single["forced"][mask], rtol=1e-4, atol=1e-4)
    assert (single["logp"][~mask] == 0).all() and (single["forced"][gen & ~mask] != 0).all()


@pytest.mark.parametrize("layout", [(1, 2, 1), (1, 1, 2), (2, 1, 1)], ids=["tp2", "pp2", "dp2"])
def test_the_same_rollouts_under_other_layouts(pool, tokenizer_dir, single, layout):
    other = _gathered(pool.run(_generate, tokenizer_dir, *layout))
    for k in ("tokens", "gen_mask", "loss_mask", "score"):
        assert torch.equal(other[k], single[k]), k
    torch.testing.assert_close(other["logp"], single["logp"], rtol=1e-4, atol=1e-4)


def _train_grads(ctx, tokenizer_dir: str, outputs: dict, algorithm: str = "grpo", packed: bool = True):
    """One train step of the actor (GRPO, RLOO, PPO, DAPO, GSPO or REINFORCE++) on the rollouts; the gradient of
    the loss with respect to the per-position log-probs, and how many micro-batches ran packed."""
    from realloc.models import engine
    from realloc.algorithms.critic_free import pg_train
    from realloc.algorithms.critic_free.critic_free import grpo_train, rloo_train
    from realloc.algorithms.critic_free.grpo import GRPOConfig, RLOOConfig
    from realloc.algorithms.ppo import ppo_interfaces
    from realloc.algorithms.ppo.ppo_config import PPOConfig
    from realloc.calls import TRAIN_STEP, ModelFunctionCallDef
    from realloc.data.tokenizer import Tokenizer
    from realloc.models.config import get_model_config

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=5, device_ids=(0,))
    if model is None:
        return None
    model.pack_sequences = packed
    seen: list[torch.Tensor] = []
    packs: list[bool] = []
    pack_layout = engine.pack_layout

    def count(layout):
        plan = pack_layout(layout)
        packs.append(plan is not None)
        return plan
    original = pg_train.response_columns

    def spy(per_position, *args, **kw):
        if per_position.requires_grad:
            per_position.retain_grad()
            seen.append(per_position)
        return original(per_position, *args, **kw)

    from realloc.algorithms.critic_free import pg_steps
    from realloc.algorithms.critic_free.pg_algorithms import DAPOConfig, GSPOConfig, ReinforcePPConfig

    steps = {"grpo": (GRPOConfig(lr=1e-3, kl_coef=0.1), grpo_train),
             "rloo": (RLOOConfig(lr=1e-3, kl_coef=0.1), rloo_train),
             "ppo": (PPOConfig(lr=1e-3, n_minibatches=1), ppo_interfaces.actor_train),
             # KL in the loss and the overlong shaping on: both read the masks
             "dapo": (DAPOConfig(lr=1e-3, kl_coef=0.1, overlong_buffer=8), pg_steps.dapo_train),
             "gspo": (GSPOConfig(lr=1e-3, kl_coef=0.1), pg_steps.gspo_train),
             "reinforce_pp": (ReinforcePPConfig(lr=1e-3, kl_coef=0.1), pg_steps.reinforce_pp_train)}
    cfg, train = steps[algorithm]
    where = ppo_interfaces if algorithm == "ppo" else pg_train
    where.response_columns, engine.pack_layout = spy, count
    try:
        call = ModelFunctionCallDef(name="actor_train", model_name="actor", interface_type=TRAIN_STEP,
                                    interface_impl=f"{algorithm}_multiturn", n_minibatches=1)
        cctx = _ctx(model, Tokenizer.load(tokenizer_dir), call, 0, N, cfg)
        cctx.optimizer, cctx.n_mbs = model.make_optimizer(cfg.lr), 1
        logp = outputs["logp"]
        inputs = {"seq": outputs["seq"], "logp": {"logp": logp}, "ref_logp": {"logp": logp * 1.1},
                  "rewards": {"score": torch.tensor([1.0, 0.0, 0.0, 1.0])},
                  "values": {"values": torch.linspace(-1, 1, logp.numel()).view_as(logp)}}
        train(cctx, inputs)
    finally:
        where.response_columns, engine.pack_layout = original, pack_layout
    return [s.grad.clone() for s in seen], sum(packs)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo", "dapo", "gspo", "reinforce_pp"])
def test_the_gradient_of_every_environment_token_log_prob_is_exactly_zero(pool, tokenizer_dir, single, algorithm):
    seq = {"tokens": single["tokens"], "gen_mask": single["gen_mask"], "loss_mask": single["loss_mask"],
           "prompt_lens": torch.tensor([len(p) for p in PROMPTS])}
    grads, _ = pool.run(_train_grads, tokenizer_dir, {"seq": seq, "logp": single["logp"]}, algorithm)[0]
    assert len(grads) >= 1
    grad = grads[0]
    for b in range(N):
        plen, k = len(PROMPTS[b]), int(single["gen_mask"][b].sum())
        policy = single["loss_mask"][b, :k]
        g = grad[b, plen:plen + k]
        assert (g[~policy] == 0).all()  # exactly zero, not small
        assert (g[policy] != 0).all()  # the policy's tokens do learn
        assert (grad[b, :plen] == 0).all() and (grad[b, plen + k:] == 0).all()


def test_a_multiturn_train_step_packed_is_the_padded_one(pool, tokenizer_dir, single):
    """Packing (on by default) on conversations with their loss masks: the same gradient as running them padded."""
    seq = {"tokens": single["tokens"], "gen_mask": single["gen_mask"], "loss_mask": single["loss_mask"],
           "prompt_lens": torch.tensor([len(p) for p in PROMPTS])}
    lengths = sorted(len(p) + int(k) for p, k in zip(PROMPTS, single["gen_mask"].sum(dim=1)))
    inputs = {"seq": seq, "logp": single["logp"]}
    (packed, n_packed), (padded, n_padded) = (pool.run(_train_grads, tokenizer_dir, inputs, "grpo", on)[0]
                                              for on in (True, False))
    assert n_packed >= 1 and n_padded == 0, lengths  # packing did run (and only in the packed step)
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-8)
    assert packed[0].abs().sum() > 0


def _error_of(ctx, tokenizer_dir: str):
    try:
        _generate(ctx, tokenizer_dir, 1, 2, 1, {**ENV, "env": "multiturn_cases:make_broken"})
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def test_an_environment_error_stops_every_rank_of_the_replica(pool, tokenizer_dir):
    errors = pool.run(_error_of, tokenizer_dir)  # tp 2: only rank 0 runs the environment; neither rank hangs
    assert errors[0] == "RuntimeError: the grader is down"
    assert errors[1].startswith("ValueError: the environment raised on the replica's reporting rank")


def test_tools_that_misbehave_end_as_observations_and_the_rollouts_go_on(pool, tokenizer_dir):
    """Issue 34's containment inside a GENERATE call: every rollout's first tool call sleeps for ever and its second
    prints 100 MB (tests/tool_cases.py); each ends at its limit as an observation the policy reads, and the rollouts
    take all their turns."""
    from realloc.data.tokenizer import Tokenizer

    tools = ["tool_cases:sleep_forever", "tool_cases:flood"]
    env = {**ENV, "env_args": {"turns": 3, "tool": True, "tool_fns": tools, "wall_s": 1.0}}
    got = _gathered(pool.run(_generate, tokenizer_dir, 1, 1, 1, env))
    sums, tok = got["sums"][0], Tokenizer.load(tokenizer_dir)
    assert sums["tool_timeout"] == sums["tool_output"] == N and sums.get("tool_ok", 0) == 0
    assert sums["turns"] == 3 * N
    for b in range(N):
        k, plen = int(got["gen_mask"][b].sum()), len(PROMPTS[b])
        runs = _runs(got["tokens"][b, plen:plen + k].tolist(), got["loss_mask"][b, :k].tolist())
        observations = [toks for is_policy, toks in runs[1:] if not is_policy]
        assert observations == [tok.encode("<timeout>", add_special_tokens=False),
                                tok.encode("<output>", add_special_tokens=False)]
        assert float(got["score"][b]) >= 0.5  # both tool steps were rewarded and the last turn was scored


def test_the_call_times_the_environment_s_steps_for_the_planner(single):
    sums = single["sums"][0]  # one dp rank: the reporting rank's stats
    assert sums["env_obs_steps"] + sums["env_final_steps"] == sums["turns"]  # one step per policy turn
    assert sums["env_obs_steps"] == sums["tool_ok"] > 0  # LengthEnv calls the tool on every step that goes on
    assert 0 < sums["env_final_steps"] <= N  # a rollout ends in a step of its own unless the budget ends it
    assert sums["env_obs_s"] > 0 and sums["env_final_s"] >= 0
