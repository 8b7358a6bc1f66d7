"""Partial rollouts (issue 31 item 5, ``algorithms/partial_rollout.py``): generation cut at K new tokens per response,
unfinished groups continued by the next iteration's generation under newer parameters.

The generation tests run ``common.actor_generate`` over several iterations on one process, with the parameters of
version v = the base model plus v times a fixed perturbation (what a train step would do), and check against
independent references: each trained token's version is within the bound; every segment a call added is what plain
generation of that one row (its prompt and earlier tokens as the prompt, the call's stream) samples at that
version; every token's log-prob is the teacher-forced log-prob under its own version's parameters; a run resumed
from the carried rows' JSON continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import math

import pytest
import torch

from mp_pool import GlooPool
from model_helpers import build_model

N, G, P, T, CUT = 8, 2, 5, 12, 4
EOS = (3, 7, 11, 19, 23, 29)  # about 1 in 10 draws ends a response: lengths from 1 to T, many over CUT
SEED = 11


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(1, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _prompts(t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    lengths = torch.randint(2, P + 1, (N // G,), generator=g).repeat_interleave(G)
    tokens = torch.zeros(N, P, dtype=torch.long)
    for b in range(0, N, G):
        row = torch.randint(32, 64, (P,), generator=g)
        tokens[b:b + G, :int(lengths[b])] = row[:int(lengths[b])]
    return {"tokens": tokens, "lengths": lengths, "rows": torch.arange(N) // G + 100 * t}


def _set_version(model, base: dict, delta: dict, v: int) -> None:
    with torch.no_grad():
        for n, p in model.params().items():
            p.copy_(base[n] + v * delta[n])


def _simulate(ctx, eta_plan: int, bound: int, iterations: int, stop_at: int | None = None, carry: str | None = None,
              start: int = 0, check: bool = True):
    """Iterations ``start``.. of generation with partial rollouts; returns each iteration's outputs, the checks'
    findings and (with ``stop_at``) the carry's JSON after that iteration."""
    from realloc.algorithms.common import actor_generate, forward_batch, response_columns
    from realloc.algorithms.context import CallContext
    from realloc.algorithms.critic_free.grpo import GRPOConfig
    from realloc.algorithms.partial_rollout import PartialRollouts
    from realloc.calls import GENERATE, ModelFunctionCallDef
    from realloc.models.config import get_model_config
    from realloc.models.generation import generate
    from realloc.models.sampling import GenerationConfig
    from realloc.models.weights import param_seed

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=5)
    gen = torch.Generator().manual_seed(9)
    base = {n: p.detach().clone() for n, p in model.params().items()}
    delta = {n: 0.05 * torch.randn(p.shape, generator=gen).to(p.dtype) for n, p in base.items()}
    call = ModelFunctionCallDef(name="actor_gen", model_name="actor", interface_type=GENERATE)
    cfg = GRPOConfig(partial_rollout_tokens=CUT)
    state = PartialRollouts(CUT, bound)
    if carry is not None:
        state.load(carry)
    outs, findings, dumped = {}, {"segments": 0, "multi_call_rows": 0, "ages": [], "lp_err": 0.0,
                                  "token_mismatch": 0}, None
    last_len: dict[int, int] = {}  # slot -> response tokens in the previous iteration's output (pending rows)
    for t in range(start, iterations):
        v = max(0, t - eta_plan)
        _set_version(model, base, delta, v)
        state.version = v
        c = CallContext(call=call, model=model, optimizer=None, config=cfg, prompt_len=P, gen_len=T, seed=SEED,
                        iteration=t, ids=range(N), batch_size=N, n_mbs=2, eos_token_ids=EOS, pad_token_id=0,
                        group_size=G, partial=state)
        res = actor_generate(c, {"prompts": _prompts(t)})
        seq, lp = res.outputs["seq"], res.outputs["logp"]
        outs[t] = {k: x.clone() for k, x in {**seq, **lp}.items()}
        glen = seq["gen_mask"].sum(dim=1)
        if check:
            for b in range(N):
                p, g, lo = int(seq["prompt_lens"][b]), int(glen[b]), last_len.get(b, 0)
                if g > lo:  # the segment this call sampled, against one row generated alone at version v
                    prompt = seq["tokens"][b, :p + lo].tolist()
                    gc = GenerationConfig(max_new_tokens=g - lo, seed=param_seed(SEED, f"generate/{t}"),
                                          eos_token_ids=EOS, pad_token_id=0)
                    ref = generate(model, [prompt], gc, seq_ids=[b])
                    findings["segments"] += 1
                    if ref.sequences[0, p + lo:p + g].tolist() != seq["tokens"][b, p + lo:p + g].tolist():
                        findings["token_mismatch"] += 1
            trained = seq["loss_mask"].any(dim=1)
            for b in torch.nonzero(trained).view(-1).tolist():
                vers = lp["version"][b][seq["gen_mask"][b]]
                findings["ages"] += [t - int(x) for x in vers]
                findings["multi_call_rows"] += int(len(set(vers.tolist())) > 1 or last_len.get(b, 0) > 0)
            # every token's log-prob under its own version, teacher-forced
            for u in sorted(set(lp["version"][seq["gen_mask"]].tolist())):
                _set_version(model, base, delta, u)
                with torch.no_grad():
                    forced = response_columns(model.forward(forward_batch(seq), n_mbs=1, output="logprobs").cpu(),
                                              seq["prompt_lens"], seq["gen_mask"])
                here = seq["gen_mask"] & (lp["version"] == u)
                findings["lp_err"] = max(findings["lp_err"], float((forced - lp["logp"])[here].abs().max()))
        last_len = {b: int(glen[b]) for b in range(N) if not bool(seq["loss_mask"][b].any())}
        if stop_at == t:
            dumped = state.dump(t, range(N))
    return {"outs": outs, "findings": findings, "carry": dumped}


@pytest.mark.parametrize("eta_plan,bound", [(0, 1), (1, 2)])
def test_partial_rollouts_keep_every_trained_token_within_the_bound_and_sample_what_the_policy_samples(
        pool, eta_plan, bound):
    res = pool.run(_simulate, eta_plan, bound, 6)[0]
    f = res["findings"]
    assert f["token_mismatch"] == 0 and f["segments"] > 10
    assert f["lp_err"] < 1e-4
    assert f["ages"] and max(f["ages"]) == bound  # within the bound, and the bound is reached
    assert f["multi_call_rows"] > 0  # some trained responses were sampled by two calls
    outs = res["outs"]
    pending = [int((~o["loss_mask"].any(dim=1)).sum()) for o in outs.values()]
    assert any(pending) and not all(pending)
    for o in outs.values():  # a pending group is pending as a whole; loss_mask is gen_mask on the others
        live = o["loss_mask"].any(dim=1).view(-1, G)
        assert (live.all(dim=1) | ~live.any(dim=1)).all()
        assert torch.equal(o["loss_mask"][live.view(-1)], o["gen_mask"][live.view(-1)])


def test_without_the_bound_a_carried_token_would_be_older(pool):
    """The check above can fail: with no bound (999) the same run trains tokens two or more versions old."""
    f = pool.run(_simulate, 0, 999, 6)[0]["findings"]
    assert max(f["ages"]) >= 2


def test_resumed_from_the_carried_rows_the_run_continues_exactly(pool):
    straight = pool.run(_simulate, 1, 2, 6, stop_at=3, check=False)[0]
    resumed = pool.run(_simulate, 1, 2, 6, carry=straight["carry"], start=4, check=False)[0]
    assert straight["carry"] and '"rows": {}' not in straight["carry"]  # something was carried
    for t in range(4, 6):
        for k, want in straight["outs"][t].items():
            assert torch.equal(resumed["outs"][t][k], want), (t, k)


def test_the_decoupled_loss_weighs_each_token_by_its_own_behaviour_version():
    """A hand-made batch: row 0's first two tokens were sampled at version 3 and the rest at version 4 (a partial
    rollout), row 1 is pending (no loss tokens). The loss is sum_t w_t min(pi_prox/pi_behav(t), cap) x clipped
    surrogate, with pi_behav(t) the log-prob recorded by the version that sampled token t."""
    from realloc.algorithms.losses import token_weights
    from realloc.algorithms.pg.pg_loss import LossOptions, policy_loss

    behav = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-1.2, -0.7, 0.0, 0.0]])  # v3, v3, v4, v4 | pending
    prox = torch.tensor([[-0.8, -2.5, -0.5, -1.0], [-1.0, -0.9, 0.0, 0.0]])
    new = torch.tensor([[-0.7, -2.0, -0.6, -1.1], [-1.1, -0.8, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [False, False, False, False]])
    w = token_weights(mask, "sequence", n_tokens=4.0, n_seqs=1.0, gen_len=4)
    loss, stats = policy_loss(new, behav, adv, w, mask, LossOptions(eps_low=0.2, eps_high=0.2), prox_logp=prox,
                              behav_cap=1.5)
    want, eps = 0.0, 0.2
    for t in range(4):
        iw = min(math.exp(float(prox[0, t] - behav[0, t])), 1.5)
        r = math.exp(float(new[0, t] - prox[0, t]))
        want += 0.25 * iw * max(-r, -min(max(r, 1 - eps), 1 + eps))
    assert float(loss) == pytest.approx(want, rel=1e-6)
    # token 3's raw weight exp(0.5) > 1.5 was truncated; the pending row weighs nothing
    assert stats["behav_capped"] == pytest.approx(0.25)


def test_partial_rollout_settings_are_checked():
    from realloc.algorithms.critic_free.grpo import GRPOConfig
    from realloc.algorithms.ppo.ppo_config import PPOConfig

    with pytest.raises(ValueError, match="partial_rollout_tokens must be a positive integer"):
        GRPOConfig(partial_rollout_tokens=0)
    with pytest.raises(ValueError, match="PPOConfig has none"):
        PPOConfig(partial_rollout_tokens=4)
    with pytest.raises(ValueError, match="cannot be combined with length_schedule or min_new_tokens"):
        GRPOConfig(partial_rollout_tokens=4, min_new_tokens=2)


def test_partial_rollouts_need_room_above_the_plans_staleness():
    from pathlib import Path

    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan, validate_plan
    from realloc.overrides import load_with_overrides

    grpo = str(Path(__file__).resolve().parents[1] / "experiments/grpo_tiny.py")
    with pytest.raises(ValueError, match=r"needs max_staleness above the plan's staleness \(0\).*max_staleness=1"):
        build_graph(load_with_overrides(grpo, ["grpo.partial_rollout_tokens=3"]))
    graph = build_graph(load_with_overrides(grpo, ["grpo.partial_rollout_tokens=3", "max_staleness=1"]))
    place = {c: ("localhost:0", 1, 1, 1, 1) for c in graph.spec.call_names}
    validate_plan(ExecutionPlan.by_hand(graph, place, staleness=0), graph)
    with pytest.raises(ValueError, match=r"plan's staleness \(1\)"):
        validate_plan(ExecutionPlan.by_hand(graph, place, staleness=1), graph)
