"""The model calls every RL algorithm shares: sample responses, score them with a policy, a critic or a
reward model (registry declarations in ``builtin.py``; the rule rewards are in ``rewards/``).

A call sees only its dp rank's sequences: ``ctx.ids`` (a range of the global batch, or an ascending
list: a streamed part, token-balanced ranks) and the matching rows of its input keys. Data keys hold
named tensors whose first dimension is the sequence. ``P`` and ``T`` are the experiment's ``prompt_len`` and ``gen_len``, both maxima:
a prompt has 1..P tokens and a response stops at EOS or after T tokens.

    prompts   tokens [n, P] int64 (right-padded), lengths [n] int64
    seq       tokens [n, P+T] int64: row b is its prompt (prompt_lens[b] tokens), then its response
              (gen_mask[b].sum() tokens, an EOS included), then padding;
              prompt_lens [n] int64, gen_mask [n, T] bool (a prefix of each row);
              a multi-turn rollout adds loss_mask [n, T] bool: its policy's tokens (``loss_mask()``)
    logp      logp [n, T] float32      per response token, under the sampling policy
    ref_logp  logp [n, T] float32
    rewards   score [n] float32        one scalar per sequence
    values    values [n, T] float32    V(state before response token t)

Per-token tensors are aligned with the response: column t is response token t, which sits at
position prompt_lens[b] + t of the row; columns past the response are 0.

The slots each function reads and writes, in the order of a call's input_data/output_data, are
declared in ``builtin.py`` (the registry checks every call against them before anything runs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.algorithms.partial_rollout import partial_generate
from realloc.models.generation import GenerationOutput
from realloc.models.sampling import GenerationConfig
from realloc.models.weights import param_seed

# (the model's output head, one micro-batch) -> (loss, extra stats): what ParallelModel.train_step calls
LossFn = Callable[[Any, Mapping[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def forward_batch(seq: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": seq["tokens"], "lengths": seq["prompt_lens"] + seq["gen_mask"].sum(dim=1)}


def scored_positions(seq: Mapping[str, torch.Tensor], pad_token_id: Any = None) -> torch.Tensor:
    """[n] the position a scalar head scores each row at, as HF's *ForSequenceClassification pools: the last token
    of prompt + response that is not the model's ``pad_token_id`` (its config.json's). A model whose pad id is
    an EOS id (``tokenizer.pad_token = tokenizer.eos_token``) is scored at the token before a final EOS, where HF
    trained and scores it; without a pad id, at the last token."""
    last = seq["prompt_lens"] + seq["gen_mask"].sum(dim=1) - 1
    if not isinstance(pad_token_id, int):
        return last
    tokens = seq["tokens"] if "tokens" in seq else seq["input_ids"]  # a train step's micro-batch: forward_batch's
    pos = torch.arange(tokens.shape[1], device=tokens.device).view(1, -1)
    kept = (pos <= last.view(-1, 1).to(tokens.device)) & (tokens != pad_token_id)
    return (pos * kept).argmax(dim=1).to(last.device)  # HF's argmax of index x non-pad: 0 when all are pad


def model_pad_id(ctx: CallContext) -> Any:
    """The pad id of the call's model's config.json (None for a model_type model)."""
    return dict(ctx.model.cfg.special_tokens).get("pad_token_id") if ctx.model is not None else None


def loss_mask(seq: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[n, T] the response tokens a train step learns from: the policy's own (``seq["loss_mask"]``, which a
    multi-turn rollout writes with its environment's tokens False: ``multiturn.py``), else all (``gen_mask``)."""
    return seq["loss_mask"] if "loss_mask" in seq else seq["gen_mask"]


def response_columns(per_position: torch.Tensor, prompt_lens: torch.Tensor, gen_mask: torch.Tensor,
                     shift: int = 0) -> torch.Tensor:
    """[n, T] response-aligned view of a per-position [n, L] tensor: column t is position
    ``prompt_lens + t + shift`` of each row (``shift=-1``: the position that predicts token t), 0 past the response."""
    T = gen_mask.shape[1]
    pos = (prompt_lens.view(-1, 1).to(per_position.device) + torch.arange(T, device=per_position.device) + shift)
    pos = pos.clamp(0, per_position.shape[1] - 1)
    return per_position.gather(1, pos) * gen_mask.to(per_position.device)


def optimizer_step(ctx: CallContext, micro: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> float:
    """One optimizer step of the call's model over ``micro``; returns the gradient norm.

    Every shipped loss is already normalized over the whole mini-batch (all dp ranks, all micro-batches). The
    engine averages gradients over dp replicas, so weighting each micro-batch by dp turns that average into the
    sum the mini-batch normalization expects. The step's learning rate is the settings' schedule at this step
    (``set_step_lr``); gradients are clipped at ``max_grad_norm``."""
    model = ctx.model
    assert model is not None and ctx.optimizer is not None
    set_step_lr(ctx, ctx.optimizer_steps)
    ctx.optimizer_steps += 1
    out = model.train_step(micro, loss_fn, ctx.optimizer, max_grad_norm=ctx.config.max_grad_norm,
                           loss_weights=[float(model.groups.dp)] * len(micro), recompute=ctx.recompute)
    return float(out["grad_norm"])


def step_lr(ctx: CallContext, k: int) -> float:
    """The learning rate of the call's optimizer step ``k`` (0-based within the call) under the settings'
    schedule: step ``iteration * n_minibatches + k`` of the run's ``schedule_steps`` (``TrainConfig.lr_at``)."""
    cfg = ctx.config
    return cfg.lr_at(getattr(cfg, ctx.lr_field or "lr"), ctx.iteration * ctx.call.n_minibatches + k,
                     ctx.schedule_steps)


def set_step_lr(ctx: CallContext, k: int) -> None:
    """Put step ``k``'s learning rate into the optimizer. Every train step gets the schedule this way, a custom
    one included (the worker sets step 0's before the call; ``optimizer_step`` sets each step's). A train step
    that sets the optimizer's learning rate itself keeps it, from then on for the rest of the call; a context
    built without ``lr_field`` (outside a run) leaves it alone."""
    if ctx.lr_field is None or ctx.optimizer is None or not ctx.lr_managed:
        return
    if ctx.lr_set is not None and ctx.optimizer.param_groups[0]["lr"] != ctx.lr_set:
        ctx.lr_managed = False  # the train step set its own
        return
    lr = step_lr(ctx, k)
    for group in ctx.optimizer.param_groups:
        group["lr"] = lr
    ctx.lr_set = lr


def generation_config(ctx: CallContext) -> GenerationConfig:
    cfg = ctx.config
    # One seed per iteration; per-sequence streams come from the sequence's global index.
    return GenerationConfig(max_new_tokens=ctx.gen_len, min_new_tokens=min(cfg.min_new_tokens, ctx.gen_len),
                            temperature=cfg.temperature, top_k=cfg.top_k,
                            top_p=cfg.top_p, greedy=ctx.greedy, seed=param_seed(ctx.seed, f"{ctx.purpose}/{ctx.iteration}"),
                            eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                            vocab_limit=ctx.vocab_limit,
                            length_schedule=None if ctx.greedy else getattr(cfg, "length_schedule", None))


# -- generation and inference ----------------------------------------------------------------------------------
def _greedy_once_per_prompt(ctx: CallContext, rows: list[list[int]], gconfig: GenerationConfig
                            ) -> GenerationOutput | None:
    """Greedy decoding of each distinct prompt once, copied to its repeats; None if every prompt is distinct.

    A greedy response depends only on its prompt, so group sampling's ``n_samples`` copies of a prompt (greedy
    evaluation of a GRPO run) would decode the same answer ``n_samples`` times."""
    assert ctx.model is not None
    seen: dict[tuple[int, ...], int] = {}
    index: list[int] = []  # row -> its distinct prompt
    reps: list[int] = []  # distinct prompt -> its first row
    for i, r in enumerate(rows):
        u = seen.setdefault(tuple(r), len(seen))
        if u == len(reps):
            reps.append(i)
        index.append(u)
    if len(reps) == len(rows):
        return None
    out = ctx.model.generate([rows[i] for i in reps], gconfig, seq_ids=[ctx.ids[i] for i in reps],
                             n_mbs=min(ctx.n_mbs, len(reps)))
    sel = torch.tensor(index)
    return dataclasses.replace(out, **{f.name: getattr(out, f.name)[sel] for f in dataclasses.fields(out)})


def actor_generate(ctx: CallContext, inputs: Data) -> CallResult:
    prompts = inputs["prompts"]
    tokens_in, plen = prompts["tokens"], prompts["lengths"]
    n, P, T = tokens_in.shape[0], ctx.prompt_len, ctx.gen_len
    assert ctx.model is not None
    gconfig = generation_config(ctx)
    if ctx.partial is not None and not ctx.greedy:  # partial rollouts: rows carried between iterations
        return partial_generate(ctx, inputs, ctx.partial, gconfig)
    # Micro-batches bound the KV cache; sampling depends only on each sequence's global index (the n
    # responses to one prompt are n sequences, ids group*n .. group*n + n-1: each draws its own stream).
    rows = [tokens_in[b, :int(plen[b])].tolist() for b in range(n)]
    out = _greedy_once_per_prompt(ctx, rows, gconfig) if gconfig.greedy else None
    if out is None:
        out = ctx.model.generate(rows, gconfig, seq_ids=list(ctx.ids), n_mbs=ctx.n_mbs)
    width = out.sequences.shape[1]
    tokens = torch.full((n, P + T), gconfig.pad_token_id, dtype=torch.long)
    tokens[:, :width] = out.sequences.cpu()
    gen_mask = torch.arange(T).view(1, T) < out.gen_lengths.cpu().view(-1, 1)
    logp = response_columns(out.logprobs.cpu(), plen, gen_mask)
    stats = {"gen_tokens": float(gen_mask.sum()), "n_seqs": float(n),
             "eos_stops": float(out.stopped_at_eos.sum()), "prompt_tokens": float(plen.sum())}
    seq = {"tokens": tokens, "prompt_lens": plen.clone(), "gen_mask": gen_mask}
    if "rows" in prompts:  # each sequence's dataset row travels with it (rewards that read the record)
        seq["rows"] = prompts["rows"].clone()
    return CallResult({"seq": seq, "logp": {"logp": logp}}, stats, {})


def actor_generate_greedy(ctx: CallContext, inputs: Data) -> CallResult:
    """The argmax response to each prompt (ReMax's baseline); its log-probs are at temperature 1."""
    return actor_generate(dataclasses.replace(ctx, greedy=True, purpose="greedy"), inputs)


def actor_logprobs(ctx: CallContext, inputs: Data) -> CallResult:
    seq = inputs["seq"]
    assert ctx.model is not None
    out = ctx.model.forward(forward_batch(seq), n_mbs=ctx.n_mbs, output="logprobs",
                            temperature=ctx.config.temperature)
    if out is None:  # not the last pipeline stage: the outputs live on the last one
        return CallResult({}, {}, {})
    logp = response_columns(out.cpu(), seq["prompt_lens"], seq["gen_mask"])
    return CallResult({"logp": {"logp": logp}}, {}, {})


def critic_values(ctx: CallContext, inputs: Data) -> CallResult:
    seq = inputs["seq"]
    assert ctx.model is not None
    out = ctx.model.forward(forward_batch(seq), n_mbs=ctx.n_mbs, output="values")
    if out is None:
        return CallResult({}, {}, {})
    # The state before response token t is the hidden state at the position just before it.
    values = response_columns(out.cpu(), seq["prompt_lens"], seq["gen_mask"], shift=-1)
    return CallResult({"values": {"values": values}}, {}, {})


def score_result(score: torch.Tensor) -> CallResult:
    """A reward call's result: one score per sequence (the reward interfaces of ``rewards/`` return it too)."""
    return CallResult({"rewards": {"score": score}}, {"score_sum": float(score.double().sum()),
                                                      "n_seqs_scored": float(score.numel())}, {})


def model_reward(ctx: CallContext, inputs: Data) -> CallResult:
    """A neural reward model: its scalar head's output at the last token of each sequence that is not its
    pad id (``scored_positions``, as HF's *ForSequenceClassification scores)."""
    seq = inputs["seq"]
    assert ctx.model is not None
    out = ctx.model.forward(forward_batch(seq), n_mbs=ctx.n_mbs, output="values")
    if out is None:
        return CallResult({}, {}, {})
    last = scored_positions(seq, model_pad_id(ctx))
    return score_result(out.cpu().gather(1, last.view(-1, 1)).squeeze(1))
