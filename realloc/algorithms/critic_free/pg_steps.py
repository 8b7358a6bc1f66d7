"""The train steps of REINFORCE++, DAPO and GSPO (settings and formulas: ``pg_algorithms.py``).

On multi-turn rollouts every token-level quantity (returns, KL, advantages, token counts) is over the policy's
tokens (``common.loss_mask``); DAPO's overlong shaping and filter count the whole conversation against gen_len.

Each computes its advantages on this dp rank's rows (with batch-wide numbers all-reduced over dp where the
formula needs the whole batch) and hands them to ``pg_train.policy_steps``, which runs the optimizer steps.
The pure functions (``reinforce_pp_advantages``, ``overlong_penalty``, ``dynamic_sampling_positions``) are what
the tests check against the papers' formulas.
"""

from __future__ import annotations

import dataclasses

import torch

from realloc.algorithms import losses
from realloc.algorithms.common import loss_mask
from realloc.algorithms.context import CallContext, CallResult, Data, dp_all_reduce
from realloc.algorithms.critic_free.critic_free import _group, reward_kl
from realloc.algorithms.critic_free.pg_train import StepsResult, actor_sums, policy_steps
from realloc.algorithms.ppo import policy_tokens, ppo


# -- REINFORCE++ ------------------------------------------------------------------------------------------------
def reinforce_pp_returns(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         kl_coef: float, estimator: str, gamma: float) -> torch.Tensor:
    """[n, T] return-to-go ``G_t = sum_{i >= t} gamma^(i - t) r_i`` of the token rewards
    ``r_i = 1[i is the last token] score - kl_coef kl_i`` (Hu et al. 2025, eqs. 1-2); 0 past the response. The tokens
    are ``mask``'s: on a multi-turn rollout the policy's alone, i and t counting them only (``policy_tokens.py``)."""
    c_logp, prefix = policy_tokens.compact(logp, mask)
    rewards, _ = ppo.kl_penalized_rewards(scores, c_logp, policy_tokens.compact(ref_logp, mask)[0], prefix, kl_coef,
                                          estimator)
    # GAE with zero values and lambda 1 is the discounted return-to-go.
    returns, _ = ppo.gae(rewards, torch.zeros_like(rewards), prefix, gamma, 1.0)
    return policy_tokens.expand(returns, mask)


def reinforce_pp_advantages(ctx: CallContext, inputs: Data, baseline: bool) -> torch.Tensor:
    """[n, T] REINFORCE++'s advantages of this rank's rows: return-to-go of the KL-shaped token rewards, normalized
    over every token of the batch (all dp ranks). ``baseline``: REINFORCE++-baseline, each response's reward minus
    its group's mean first."""
    cfg = ctx.config
    mask = loss_mask(inputs["seq"])
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    score = inputs["rewards"]["score"]
    if baseline:
        g = _group(ctx, score.numel())
        groups = score.double().view(-1, g)
        score = (groups - groups.mean(dim=1, keepdim=True)).view(-1).to(score.dtype)
    returns = reinforce_pp_returns(score, logp, ref_logp, mask, cfg.kl_in_reward, cfg.kl_estimator, cfg.gamma)
    return ppo.whiten(returns, mask, dp_all_reduce(ctx.model, ppo.masked_moments(returns, mask)))


def _reinforce_pp(ctx: CallContext, inputs: Data, baseline: bool) -> CallResult:
    adv = reinforce_pp_advantages(ctx, inputs, baseline)
    steps = policy_steps(ctx, inputs, adv)
    return _result(ctx, steps, inputs, adv, n_tokens_of=loss_mask(inputs["seq"]))


def reinforce_pp_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _reinforce_pp(ctx, inputs, baseline=False)


def reinforce_pp_baseline_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _reinforce_pp(ctx, inputs, baseline=True)


# -- DAPO -------------------------------------------------------------------------------------------------------
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of responses of ``lengths`` tokens, with
    ``L_max = max_len`` and ``L_cache = buffer``: 0 up to ``L_max - L_cache``, then ``((L_max - L_cache) - |y|) / L_cache``
    (down to -1 at ``L_max``), times ``penalty``. ``buffer`` 0: no penalty."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    free = max_len - buffer
    over = (lengths.to(torch.float64) - free).clamp(min=0.0)
    return (-(over / buffer).clamp(max=1.0) * penalty).to(torch.float32)


def dynamic_sampling_positions(keep: torch.Tensor, group: int, n_train: int) -> torch.Tensor:
    """Each sequence's position in the train batch, -1 if dropped: the first ``n_train`` groups with ``keep``
    (global, in prompt order) are trained, their sequences numbered in order. ``keep`` [n_groups] bool."""
    rank = torch.cumsum(keep.to(torch.long), 0) - 1
    chosen = keep & (rank < n_train)
    pos_group = torch.where(chosen, rank, torch.full_like(rank, -1))
    offsets = torch.arange(group).view(1, -1)
    pos = torch.where(chosen.view(-1, 1), pos_group.view(-1, 1) * group + offsets, torch.full_like(offsets, -1))
    return pos.reshape(-1)


@dataclasses.dataclass
class DAPOSelection:
    position: torch.Tensor  # [n] each row's place in the train batch, -1: dropped
    advantages: torch.Tensor  # [n] group-normalized, 0 for a dropped row
    shaping: torch.Tensor  # [n] the overlong penalty added to each reward
    groups_kept: int  # groups of the whole batch whose rewards differ
    groups_trained: int
    in_trained_group: torch.Tensor  # [n] the row's group is trained (the row itself may be filtered as truncated)
    truncated_filtered: int = 0  # rows of the trained groups left out as truncated (overlong_filter), whole batch


def truncated_responses(seq: dict[str, torch.Tensor], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """[n] bool: the response filled ``gen_len`` without ending in an EOS token (generation cut it off)."""
    mask = seq["gen_mask"]
    n_tok = mask.sum(dim=1)
    last = seq["tokens"].gather(1, (seq["prompt_lens"] + n_tok - 1).clamp(min=0).view(-1, 1)).view(-1)
    eos = torch.as_tensor(list(eos_token_ids), dtype=last.dtype)
    return (n_tok == mask.shape[1]) & ~torch.isin(last, eos)


def dapo_selection(ctx: CallContext, inputs: Data) -> DAPOSelection:
    """DAPO's rewards (plus the overlong penalty), its dynamic sampling over the whole batch, and the group-normalized
    advantages of this rank's rows."""
    cfg = ctx.config
    mask = loss_mask(inputs["seq"])  # the policy's tokens (multi-turn); lengths count the whole conversation
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    if cfg.overlong_buffer >= ctx.gen_len:
        raise ValueError(f"call {ctx.call.name!r}: dapo.overlong_buffer={cfg.overlong_buffer} must be below gen_len="
                         f"{ctx.gen_len}")
    lengths = inputs["seq"]["gen_mask"].sum(dim=1)
    shaping = overlong_penalty(lengths, ctx.gen_len, cfg.overlong_buffer, cfg.overlong_penalty)
    score = inputs["rewards"]["score"] + shaping
    g = _group(ctx, score.numel())
    n_groups = ctx.batch_size // g
    ids = torch.as_tensor(list(ctx.ids), dtype=torch.long)  # a range or a row list of whole groups
    local_groups = score.view(-1, g)
    # A group whose (shaped) rewards are all equal has advantage 0 for every response: no gradient, only a dilution
    # of the loss's normalization. Whether a group is kept is decided on every rank alike, from all ranks' flags.
    keep_local = (local_groups.max(dim=1).values != local_groups.min(dim=1).values) if cfg.dynamic_sampling \
        else torch.ones(local_groups.shape[0], dtype=torch.bool)
    flags = torch.zeros(n_groups, dtype=torch.float64)
    flags[ids[::g] // g] = keep_local.double()
    keep = dp_all_reduce(ctx.model, flags) > 0.5
    n_train = cfg.trained_prompts(n_groups)
    position = dynamic_sampling_positions(keep, g, n_train)[ids]
    in_group = position >= 0
    filtered = 0
    if cfg.overlong_filter:  # DAPO §3.4: a truncated response's loss is masked (its group's baseline still counts it)
        cut = truncated_responses(inputs["seq"], ctx.eos_token_ids) & in_group
        position = torch.where(cut, torch.full_like(position, -1), position)
        filtered = int(dp_all_reduce(ctx.model, cut.sum().double().view(1))[0])
    adv = losses.group_advantages(score - cfg.kl_coef * reward_kl(cfg, logp, ref_logp, mask), g, scale=True)
    adv = torch.where(position >= 0, adv, torch.zeros_like(adv))
    return DAPOSelection(position, adv, shaping, int(keep.sum()), min(int(keep.sum()), n_train), in_group, filtered)


def dapo_train(ctx: CallContext, inputs: Data) -> CallResult:
    mask = loss_mask(inputs["seq"])
    sel = dapo_selection(ctx, inputs)
    adv = sel.advantages.view(-1, 1).to(inputs["logp"]["logp"].dtype) * mask
    steps = policy_steps(ctx, inputs, adv, position=sel.position)
    out = _result(ctx, steps, inputs, adv, n_tokens_of=mask & (sel.position >= 0).view(-1, 1))
    if out.sums:
        n_trained = sel.groups_trained * ctx.group_size
        # the reward (before the length penalty) of the trained groups' sequences: dropped groups left out
        score = inputs["rewards"]["score"][sel.in_trained_group]
        out.sums["trained_reward"] = float(score.double().sum()) / max(n_trained, 1)
        out.sums["overlong_penalty"] = float(sel.shaping.double().sum()) / ctx.batch_size
        out.globals.update({"groups_kept": float(sel.groups_kept), "groups_trained": float(sel.groups_trained),
                            "groups_generated": float(ctx.batch_size // ctx.group_size)})
        if ctx.config.overlong_filter:
            out.globals["truncated_filtered"] = float(sel.truncated_filtered)
    return out


# -- GSPO -------------------------------------------------------------------------------------------------------
def gspo_train(ctx: CallContext, inputs: Data) -> CallResult:
    model, cfg = ctx.model, ctx.config
    assert model is not None
    mask = loss_mask(inputs["seq"])
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    score = inputs["rewards"]["score"] - cfg.kl_coef * reward_kl(cfg, logp, ref_logp, mask)
    adv_seq = losses.group_advantages(score, _group(ctx, score.numel()), scale=True)
    adv = adv_seq.view(-1, 1).to(logp.dtype) * mask
    steps = policy_steps(ctx, inputs, adv, sequence_ratio=True)
    return _result(ctx, steps, inputs, adv, n_tokens_of=mask)


def _result(ctx: CallContext, steps: StepsResult, inputs: Data, adv: torch.Tensor,
            n_tokens_of: torch.Tensor) -> CallResult:
    """The stats every one of these train steps reports; ``adv_abs_mean`` is the mean |advantage| per trained
    token (``n_tokens_of``: the trained tokens of this rank), over the whole batch."""
    model = ctx.model
    assert model is not None
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": steps.grad_norm})
    mask = loss_mask(inputs["seq"])
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    sums = actor_sums(steps, ctx.config)
    sums["kl"] = float(losses.sequence_kl(logp, ref_logp, mask).double().sum()) / ctx.batch_size
    tokens = dp_all_reduce(model, n_tokens_of.sum().double().view(1))
    sums["adv_abs_mean"] = float((adv.abs() * n_tokens_of).double().sum()) / max(float(tokens[0]), 1.0)
    return CallResult({}, sums, {"actor_grad_norm": steps.grad_norm, "actor_lr": steps.lr})
