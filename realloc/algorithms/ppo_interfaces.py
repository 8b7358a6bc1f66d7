"""The model function calls of PPO (realhf.txt §2.1, Figure 1) on a ``ParallelModel``.

A call sees only its dp rank's sequences: ``ctx.ids`` (a contiguous range of the global batch)
and the matching rows of its input keys. Data keys hold named tensors whose first dimension is
the sequence. ``P`` and ``T`` are the experiment's ``prompt_len`` and ``gen_len``, both maxima:
a prompt has 1..P tokens and a response stops at EOS or after T tokens.

    prompts   tokens [n, P] int64 (right-padded), lengths [n] int64
    seq       tokens [n, P+T] int64: row b is its prompt (prompt_lens[b] tokens), then its response
              (gen_mask[b].sum() tokens, an EOS included), then padding;
              prompt_lens [n] int64, gen_mask [n, T] bool (a prefix of each row)
    logp      logp [n, T] float32      per response token, under the sampling policy
    ref_logp  logp [n, T] float32
    rewards   score [n] float32        one scalar per sequence
    values    values [n, T] float32    V(state before response token t)

Per-token tensors are aligned with the response: column t is response token t, which sits at
position prompt_lens[b] + t of the row; columns past the response are 0.

Roles are positional: a GENERATE call reads ``[prompts]`` and writes ``[seq, logp]``; inference
calls read ``[seq]`` and write one key; train steps read ``[seq, logp, ref_logp, rewards, values]``.

Layout invariance. Mini-batch k is the set of sequences whose global index is k mod M, whatever
the dp degree; advantages are whitened with batch-wide moments and losses are divided by the
mini-batch's global token count (both all-reduced over dp), and the engine's dp gradient
average is undone by weighting every micro-batch by dp. Hence any plan takes the same optimizer
steps as a single device would, up to floating-point rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from realloc.algorithms import ppo, rule_reward
from realloc.algorithms.ppo_config import PPOConfig
from realloc.api import InterfaceType, ModelFunctionCallDef
from realloc.models.batch import split_batch
from realloc.models.engine import ParallelModel
from realloc.models.sampling import GenerationConfig
from realloc.models.weights import param_seed

Data = dict[str, dict[str, torch.Tensor]]  # key -> tensor name -> [n, ...]
TRAIN_ROLES = ("seq", "logp", "ref_logp", "rewards", "values")


@dataclasses.dataclass
class CallContext:
    call: ModelFunctionCallDef
    model: ParallelModel | None  # None for a rule function
    optimizer: torch.optim.Optimizer | None
    ppo: PPOConfig
    prompt_len: int
    gen_len: int
    seed: int
    iteration: int
    ids: range  # global sequence indices of this dp rank's rows
    batch_size: int  # sequences of the whole batch
    n_mbs: int
    total_iterations: int = 0  # the run's horizon, for the learning-rate schedule (0: iteration + 1)
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these (the tokenizer's EOS)
    pad_token_id: int = 0
    greedy: bool = False  # generation: argmax instead of sampling (evaluation)
    purpose: str = "generate"  # names the sampling stream: training and each eval batch draw their own
    recompute: bool = False  # train steps recompute activations (CallPlacement.recompute)


@dataclasses.dataclass
class CallResult:
    outputs: Data  # by output role (positional key names are applied by the caller)
    sums: dict[str, float]  # additive over dp ranks (the master sums the dp ranks' reports)
    globals: dict[str, float]  # identical on every dp rank (reported once)


# -- helpers -------------------------------------------------------------------------------------------------
def _dp_all_reduce(model: ParallelModel | None, t: torch.Tensor) -> torch.Tensor:
    if model is None or model.groups.dp == 1:
        return t
    t = t.to(model.device)
    dist.all_reduce(t, group=model.groups.dp_group)
    return t.cpu()


def _forward_batch(seq: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": seq["tokens"], "lengths": seq["prompt_lens"] + seq["gen_mask"].sum(dim=1)}


def response_columns(per_position: torch.Tensor, prompt_lens: torch.Tensor, gen_mask: torch.Tensor,
                     shift: int = 0) -> torch.Tensor:
    """[n, T] response-aligned view of a per-position [n, L] tensor: column t is position
    ``prompt_lens + t + shift`` of each row (``shift=-1``: the position that predicts token t), 0 past the response."""
    T = gen_mask.shape[1]
    pos = (prompt_lens.view(-1, 1).to(per_position.device) + torch.arange(T, device=per_position.device) + shift)
    pos = pos.clamp(0, per_position.shape[1] - 1)
    return per_position.gather(1, pos) * gen_mask.to(per_position.device)


def generation_config(ctx: CallContext) -> GenerationConfig:
    cfg = ctx.ppo
    # One seed per iteration; per-sequence streams come from the sequence's global index.
    return GenerationConfig(max_new_tokens=ctx.gen_len, temperature=cfg.temperature, top_k=cfg.top_k,
                            top_p=cfg.top_p, greedy=ctx.greedy, seed=param_seed(ctx.seed, f"{ctx.purpose}/{ctx.iteration}"),
                            eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id)


# -- generation and inference ----------------------------------------------------------------------------------
def actor_generate(ctx: CallContext, inputs: Data) -> CallResult:
    prompts = inputs["prompts"]
    tokens_in, plen = prompts["tokens"], prompts["lengths"]
    n, P, T = tokens_in.shape[0], ctx.prompt_len, ctx.gen_len
    assert ctx.model is not None
    gconfig = generation_config(ctx)
    # Micro-batches bound the KV cache; sampling depends only on each sequence's global index.
    rows = [tokens_in[b, :int(plen[b])].tolist() for b in range(n)]
    out = ctx.model.generate(rows, gconfig, seq_ids=list(ctx.ids), n_mbs=ctx.n_mbs)
    width = out.sequences.shape[1]
    tokens = torch.full((n, P + T), gconfig.pad_token_id, dtype=torch.long)
    tokens[:, :width] = out.sequences.cpu()
    gen_mask = torch.arange(T).view(1, T) < out.gen_lengths.cpu().view(-1, 1)
    logp = response_columns(out.logprobs.cpu(), plen, gen_mask)
    stats = {"gen_tokens": float(gen_mask.sum()), "n_seqs": float(n),
             "eos_stops": float(out.stopped_at_eos.sum()), "prompt_tokens": float(plen.sum())}
    return CallResult({"seq": {"tokens": tokens, "prompt_lens": plen.clone(), "gen_mask": gen_mask},
                       "logp": {"logp": logp}}, stats, {})


def actor_logprobs(ctx: CallContext, inputs: Data) -> CallResult:
    seq = inputs["seq"]
    assert ctx.model is not None
    out = ctx.model.forward(_forward_batch(seq), n_mbs=ctx.n_mbs, output="logprobs",
                            temperature=ctx.ppo.temperature)
    if out is None:  # not the last pipeline stage: the outputs live on the last one
        return CallResult({}, {}, {})
    logp = response_columns(out.cpu(), seq["prompt_lens"], seq["gen_mask"])
    return CallResult({"logp": {"logp": logp}}, {}, {})


def critic_values(ctx: CallContext, inputs: Data) -> CallResult:
    seq = inputs["seq"]
    assert ctx.model is not None
    out = ctx.model.forward(_forward_batch(seq), n_mbs=ctx.n_mbs, output="values")
    if out is None:
        return CallResult({}, {}, {})
    # The state before response token t is the hidden state at the position just before it.
    values = response_columns(out.cpu(), seq["prompt_lens"], seq["gen_mask"], shift=-1)
    return CallResult({"values": {"values": values}}, {}, {})


def model_reward(ctx: CallContext, inputs: Data) -> CallResult:
    """A neural reward model: its scalar head's output at the last token of each sequence (as HF's
    *ForSequenceClassification scores the last non-padding token)."""
    seq = inputs["seq"]
    assert ctx.model is not None
    out = ctx.model.forward(_forward_batch(seq), n_mbs=ctx.n_mbs, output="values")
    if out is None:
        return CallResult({}, {}, {})
    last = seq["prompt_lens"] + seq["gen_mask"].sum(dim=1) - 1
    score = out.cpu().gather(1, last.view(-1, 1)).squeeze(1)
    return CallResult({"rewards": {"score": score}}, {"score_sum": float(score.double().sum()),
                                                      "n_seqs_scored": float(score.numel())}, {})


def split_prompt_response(seq: Mapping[str, torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens [n, P] right-padded, response tokens [n, T] aligned with gen_mask; pad elsewhere)."""
    tokens, plen, mask = seq["tokens"], seq["prompt_lens"], seq["gen_mask"]
    P = tokens.shape[1] - mask.shape[1]
    prompt_mask = torch.arange(P).view(1, P) < plen.view(-1, 1)
    prompt = torch.where(prompt_mask, tokens[:, :P], torch.full_like(tokens[:, :P], pad_token_id))
    response = torch.where(mask, response_columns(tokens, plen, mask), torch.full_like(mask, pad_token_id,
                                                                                       dtype=tokens.dtype))
    return prompt, response


def rule_scores(ctx: CallContext, inputs: Data) -> CallResult:
    seq = inputs["seq"]
    prompt, response = split_prompt_response(seq, ctx.pad_token_id)
    score = rule_reward.score(ctx.call.name, ctx.call.interface_args, prompt, response, seq["gen_mask"])
    return CallResult({"rewards": {"score": score}}, {"score_sum": float(score.double().sum()),
                                                      "n_seqs_scored": float(score.numel())}, {})


# -- training --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Rollout:
    seq: Mapping[str, torch.Tensor]
    old_logp: torch.Tensor
    old_values: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor  # whitened with batch-wide moments
    returns: torch.Tensor
    kl: torch.Tensor  # [n, T] logp - ref_logp on valid tokens
    n_tokens: list[float]  # per mini-batch, over the whole batch


def _rollout(ctx: CallContext, inputs: Data, whiten: bool) -> _Rollout:
    cfg = ctx.ppo
    seq = inputs["seq"]
    mask = seq["gen_mask"]
    logp, ref_logp = inputs["logp"]["logp"], inputs["ref_logp"]["logp"]
    values = inputs["values"]["values"]
    rewards, kl = ppo.kl_penalized_rewards(inputs["rewards"]["score"], logp, ref_logp, mask, cfg.kl_coef)
    adv, returns = ppo.gae(rewards, values, mask, cfg.gamma, cfg.gae_lambda)
    M = ctx.call.n_minibatches
    mb_of_row = torch.tensor([i % M for i in ctx.ids])
    local = torch.cat([ppo.masked_moments(adv, mask),
                       torch.stack([mask[mb_of_row == k].sum().double() for k in range(M)])])
    total = _dp_all_reduce(ctx.model, local)
    if whiten:
        adv = ppo.whiten(adv, mask, total[:3])
    return _Rollout(seq, logp, values, mask, adv, returns, kl, [float(x) for x in total[3:]])


def _train(ctx: CallContext, inputs: Data, actor: bool) -> CallResult:
    model, cfg = ctx.model, ctx.ppo
    assert model is not None and ctx.optimizer is not None
    ro = _rollout(ctx, inputs, whiten=actor)
    M = ctx.call.n_minibatches
    dp = model.groups.dp
    loss_sum = clipped = approx_kl = grad_norm = 0.0
    base_lr = cfg.lr if actor else cfg.critic_lr
    total_steps = max(ctx.total_iterations, ctx.iteration + 1) * M
    lrs = [cfg.lr_at(base_lr, ctx.iteration * M + k, total_steps) for k in range(M)]
    for k in range(M):
        for group in ctx.optimizer.param_groups:
            group["lr"] = lrs[k]
        rows = torch.tensor([r for r, i in enumerate(ctx.ids) if i % M == k], dtype=torch.long)
        n_tok = max(ro.n_tokens[k], 1.0)
        mb = {**_forward_batch({n: t[rows] for n, t in ro.seq.items()}),
              "prompt_lens": ro.seq["prompt_lens"][rows], "mask": ro.mask[rows], "old_logp": ro.old_logp[rows], "old_values": ro.old_values[rows],
              "advantages": ro.advantages[rows], "returns": ro.returns[rows]}
        parts: list[ppo.LossStats] = []

        def loss_fn(head: Any, m: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
            if actor:
                new = response_columns(head.logprobs(cfg.temperature), m["prompt_lens"], m["mask"])
                loss, st = ppo.actor_loss(new, m["old_logp"], m["advantages"], m["mask"], cfg.clip_eps, n_tok)
            else:
                new = response_columns(head.values, m["prompt_lens"], m["mask"], shift=-1)
                loss, st = ppo.critic_loss(new, m["old_values"], m["returns"], m["mask"], cfg.value_clip_eps, n_tok)
            parts.append(st)
            return loss, {}

        micro = split_batch(mb, ctx.n_mbs)
        # The engine averages gradients over dp replicas; weighting by dp turns that into the sum that
        # the global token normalization expects.
        out = model.train_step(micro, loss_fn, ctx.optimizer, max_grad_norm=cfg.max_grad_norm,
                               loss_weights=[float(dp)] * len(micro), recompute=ctx.recompute)
        grad_norm += out["grad_norm"] / M
        loss_sum += sum(p.loss_sum for p in parts) / n_tok / M
        clipped += sum(p.clipped_tokens for p in parts) / n_tok / M
        approx_kl += sum(p.approx_kl_sum for p in parts) / n_tok / M
    if not model.groups.is_last_stage:
        return CallResult({}, {}, {"grad_norm": grad_norm})
    prefix = "actor" if actor else "critic"
    sums = {f"{prefix}_loss": loss_sum, f"{prefix}_clip_frac": clipped}
    if actor:
        sums["approx_kl"] = approx_kl
        sums["kl"] = float(ro.kl.double().sum()) / ctx.batch_size  # per sequence, summed over its tokens
        sums["adv_abs_mean"] = float((ro.advantages.abs() * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
    else:
        sums["value_mean"] = float((ro.old_values * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
        sums["return_mean"] = float((ro.returns * ro.mask).double().sum()) / max(sum(ro.n_tokens), 1.0)
    return CallResult({}, sums, {f"{prefix}_grad_norm": grad_norm, f"{prefix}_lr": lrs[0]})


def actor_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, actor=True)


def critic_train(ctx: CallContext, inputs: Data) -> CallResult:
    return _train(ctx, inputs, actor=False)


# -- dispatch ----------------------------------------------------------------------------------------------------
Impl = Callable[[CallContext, Data], CallResult]
# (interface_impl, interface type) -> (function, input roles, output roles)
IMPLS: Mapping[tuple[str, InterfaceType], tuple[Impl, tuple[str, ...], tuple[str, ...]]] = {
    ("ppo_actor", InterfaceType.GENERATE): (actor_generate, ("prompts",), ("seq", "logp")),
    ("ppo_actor", InterfaceType.INFERENCE): (actor_logprobs, ("seq",), ("logp",)),
    ("ppo_actor", InterfaceType.TRAIN_STEP): (actor_train, TRAIN_ROLES, ()),
    ("ppo_critic", InterfaceType.INFERENCE): (critic_values, ("seq",), ("values",)),
    ("ppo_critic", InterfaceType.TRAIN_STEP): (critic_train, TRAIN_ROLES, ()),
    ("reward", InterfaceType.INFERENCE): (model_reward, ("seq",), ("rewards",)),
    ("rule_reward", InterfaceType.INFERENCE): (rule_scores, ("seq",), ("rewards",)),
}


def resolve(call: ModelFunctionCallDef, is_critic: bool) -> tuple[Impl, dict[str, str], dict[str, str]]:
    """The implementation of ``call`` and its key maps (role -> key for inputs, role -> key for outputs)."""
    impl = call.interface_impl
    if impl is None:
        impl = "ppo_critic" if is_critic else "ppo_actor"
    entry = IMPLS.get((impl, call.interface_type))
    if entry is None:
        raise ValueError(f"call {call.name!r}: interface_impl {impl!r} has no {call.interface_type.name} "
                         f"implementation in the runtime")
    fn, in_roles, out_roles = entry
    if len(call.input_data) != len(in_roles) or len(call.output_data) != len(out_roles):
        raise ValueError(f"call {call.name!r}: {impl} {call.interface_type.name} reads {len(in_roles)} key(s) "
                         f"({', '.join(in_roles)}) and writes {len(out_roles)} ({', '.join(out_roles) or 'none'}), "
                         f"in that order; the call lists input_data={list(call.input_data)} "
                         f"output_data={list(call.output_data)}")
    return fn, dict(zip(in_roles, call.input_data)), dict(zip(out_roles, call.output_data))
