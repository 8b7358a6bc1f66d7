"""Partial rollouts: a generation call cut at a number of new tokens per response, the unfinished responses
continued by the next iteration's generation under the newer parameters (docs/partial-rollouts.md).

With bounded staleness (asynchronous RL, docs/async-rl.md) generation need not wait for a batch's longest
response: Kimi k1.5 (§2.6.2, "partial rollouts") and AReaL (§4, interruptible generation) stop long responses
and go on with them later under new weights. Here, with ``partial_rollout_tokens = K``:

- Each slot of the batch (a global sequence index) holds a *row*: a prompt, the response tokens so far, each
  token's log-prob under the policy that sampled it, and each token's *version* (train steps applied to the
  parameters that sampled it). A fresh row starts from the iteration's prompt of its slot; a carried row keeps
  its slot, and that iteration's prompt of the slot is skipped.
- A generation call gives every unfinished row at most K new tokens (never past ``gen_len``): its prompt and
  tokens so far are prefilled again under the current parameters, then it samples from the call's own stream
  (the iteration's seed and the slot), exactly as ``generate`` samples any prompt.
- The unit that is trained is a *group* (the ``n_samples`` responses to one prompt, which GRPO and RLOO
  normalize together). A group whose rows have all finished (EOS or ``gen_len``) is trained in this iteration;
  any other group is *pending*: its rows go downstream with ``loss_mask`` all False (the train step gives them
  weight 0) and the whole group is carried into the next call. A finished row of a pending group waits.
- **The staleness bound, per token.** A token sampled by parameters of version v and trained by the train step
  of iteration t (which starts from version t) is t - v versions old. With ``bound`` = the experiment's
  ``max_staleness`` (eta), no trained token is more than eta versions old: a call of iteration t cuts a group only
  if ``t + 1 - v_min <= eta``, v_min the oldest version among the group's tokens and the current one (the group
  would be trained at iteration t + 1 at the earliest); otherwise its rows decode to their end in this call.
  A plan whose generation runs eta_plan steps ahead samples at version t - eta_plan, so a group spans at most
  ``eta - eta_plan + 1`` calls (``graph/partial_check.py`` refuses eta_plan = eta, where nothing could be cut).

The decoupled objective (``pg/pg_loss.py``) needs nothing new: its behaviour log-probs are per token already, and a
continued response's tokens carry the log-probs of the version that sampled each of them.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch

from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.models.sampling import GenerationConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PartialRow:
    """One slot's response in progress (immutable: a call makes new rows, so history keeps old ones)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...] = ()
    logp: tuple[float, ...] = ()  # per token, under the version that sampled it
    versions: tuple[int, ...] = ()  # per token: train steps applied to the parameters that sampled it
    eos: bool = False
    finished: bool = False  # EOS or gen_len reached
    record: int = -1  # the dataset row the prompt came from (the prompts' "rows"), -1: none


class PartialRollouts:
    """The carried rows of one generation call on one worker, with the snapshots a checkpoint needs.

    ``carry`` maps slot -> row after the latest call; ``history[t]`` is the carry after iteration t's call (a
    checkpoint after n iterations keeps ``history[n - 1]``: generation may already have run ahead of it)."""

    def __init__(self, cut: int, bound: int) -> None:
        # generation runs at most bound (> the plan's staleness) + 1 iterations ahead of a checkpoint being written
        self.cut, self.bound, self.keep = cut, bound, bound + 4
        self.version = 0  # the parameters' version for the next call (the worker sets it)
        self.carry: dict[int, PartialRow] = {}
        self.history: dict[int, dict[int, PartialRow]] = {}

    def remember(self, iteration: int) -> None:
        self.history[iteration] = dict(self.carry)
        for t in [t for t in self.history if t <= iteration - self.keep]:
            del self.history[t]

    def dump(self, iteration: int, slots: range) -> str:
        """JSON of the carry after ``iteration``'s call, for ``slots`` (floats keep every bit: float32 -> float)."""
        rows = self.history.get(iteration, {}) if iteration >= 0 else {}
        return json.dumps({"iteration": iteration, "rows": {str(s): dataclasses.asdict(r) for s, r in
                                                            sorted(rows.items()) if s in slots}})

    def load(self, text: str) -> None:
        """Add the rows of a ``dump`` to the carry."""
        for s, r in json.loads(text)["rows"].items():
            self.carry[int(s)] = PartialRow(**{k: tuple(v) if isinstance(v, list) else v for k, v in r.items()})


def _budgets(ctx: CallContext, state: PartialRollouts, rows: list[PartialRow]) -> list[int]:
    """New tokens each row may take in this call: the cut, or the rest of ``gen_len`` for a group that the
    staleness bound does not let wait another iteration; 0 for a finished row."""
    out: list[int] = []
    G = ctx.group_size
    for g0 in range(0, len(rows), G):
        group = rows[g0:g0 + G]
        oldest = min([state.version] + [min(r.versions) for r in group if r.versions])
        last_call = ctx.iteration + 1 - oldest > state.bound
        for r in group:
            left = ctx.gen_len - len(r.tokens)
            out.append(0 if r.finished else left if last_call else min(state.cut, left))
    return out


def _drop_too_old(ctx: CallContext, state: PartialRollouts) -> int:
    """Drop the carried groups that even a last call could not train within the bound (this iteration's train step
    starts from version ``ctx.iteration``): only after a resume that lowered ``max_staleness``, as the budgets keep
    it from happening otherwise. Their slots start again from this iteration's prompts; returns how many rows."""
    G, drop = ctx.group_size, []
    for g0 in range(ctx.ids.start, ctx.ids.stop, G):
        group = [s for s in range(g0, g0 + G) if s in state.carry]
        versions = [min(state.carry[s].versions) for s in group if state.carry[s].versions]
        if versions and ctx.iteration - min(versions) > state.bound:
            drop += group
    for s in drop:
        del state.carry[s]
    return len(drop)


def _rows(ctx: CallContext, state: PartialRollouts, prompts: dict[str, torch.Tensor]) -> list[PartialRow]:
    rows = []
    for b, s in enumerate(ctx.ids):
        carried = state.carry.get(s)
        if carried is not None:
            rows.append(carried)
            continue
        n = int(prompts["lengths"][b])
        record = int(prompts["rows"][b]) if "rows" in prompts else -1
        rows.append(PartialRow(prompt=tuple(prompts["tokens"][b, :n].tolist()), record=record))
    return rows


def partial_generate(ctx: CallContext, inputs: Data, state: PartialRollouts, gconfig: GenerationConfig) -> CallResult:
    """``common.actor_generate`` with partial rollouts (module docstring): the same outputs, plus
    ``seq["loss_mask"]`` (False on pending groups) and ``logp["version"]`` [n, T] int32 per token."""
    assert ctx.model is not None
    G, n, P, T = ctx.group_size, len(ctx.ids), ctx.prompt_len, ctx.gen_len
    if ctx.ids.start % G or n % G:
        raise ValueError(f"call {ctx.call.name!r}: partial rollouts carry whole groups of {G} responses, but this "
                         f"rank holds sequences {ctx.ids.start}..{ctx.ids.stop - 1}; give the generation call a dp "
                         f"degree that divides batch_size / n_samples")
    dropped = _drop_too_old(ctx, state)
    if dropped:
        log.warning("call %r, iteration %d: %d carried responses hold tokens more than max_staleness = %d versions "
                    "old (lowered on resume); they start again from this iteration's prompts", ctx.call.name,
                    ctx.iteration + 1, dropped, state.bound)
    continued = sum(1 for s in ctx.ids if s in state.carry)
    rows = _rows(ctx, state, inputs["prompts"])
    budgets = _budgets(ctx, state, rows)
    new_tokens = 0
    # One generate per distinct budget: rows of equal budget have equal room, so prompt + tokens so far + budget
    # stays within prompt_len + gen_len (the model's positions); each row's draws depend on its slot alone.
    for budget in sorted(set(budgets) - {0}):
        idx = [b for b in range(n) if budgets[b] == budget]
        out = ctx.model.generate([list(rows[b].prompt + rows[b].tokens) for b in idx],
                                 dataclasses.replace(gconfig, max_new_tokens=budget),
                                 seq_ids=[ctx.ids[b] for b in idx], n_mbs=min(ctx.n_mbs, len(idx)))
        for j, b in enumerate(idx):
            p, g = int(out.prompt_lengths[j]), int(out.gen_lengths[j])
            r, eos = rows[b], bool(out.stopped_at_eos[j])
            tokens = r.tokens + tuple(out.sequences[j, p:p + g].tolist())
            rows[b] = dataclasses.replace(r, tokens=tokens, logp=r.logp + tuple(out.logprobs[j, p:p + g].tolist()),
                                          versions=r.versions + (state.version,) * g, eos=eos,
                                          finished=eos or len(tokens) >= T)
            new_tokens += g
    done = [all(r.finished for r in rows[g0:g0 + G]) for g0 in range(0, n, G)]
    tokens = torch.full((n, P + T), gconfig.pad_token_id, dtype=torch.long)
    plen, glen = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    logp, version = torch.zeros((n, T), dtype=torch.float32), torch.zeros((n, T), dtype=torch.int32)
    for b, r in enumerate(rows):
        p, g = len(r.prompt), len(r.tokens)
        tokens[b, :p + g] = torch.tensor(r.prompt + r.tokens)
        plen[b], glen[b] = p, g
        logp[b, :g] = torch.tensor(r.logp, dtype=torch.float32)
        version[b, :g] = torch.tensor(r.versions, dtype=torch.int32)
    gen_mask = torch.arange(T).view(1, T) < glen.view(-1, 1)
    trained = torch.tensor(done).repeat_interleave(G)
    state.carry = {s: rows[b] for b, s in enumerate(ctx.ids) if not done[b // G]}
    state.remember(ctx.iteration)
    seq = {"tokens": tokens, "prompt_lens": plen, "gen_mask": gen_mask, "loss_mask": gen_mask & trained.view(-1, 1)}
    if "rows" in inputs["prompts"]:
        seq["rows"] = torch.tensor([r.record for r in rows], dtype=inputs["prompts"]["rows"].dtype)
    # the bound per token (module docstring): this batch's train step starts from version ctx.iteration
    ages = ctx.iteration - version[gen_mask & trained.view(-1, 1)].long()
    assert not bool((ages > state.bound).any()), f"a trained token is {int(ages.max())} versions old"
    stats = {"gen_tokens": float(gen_mask.sum()), "n_seqs": float(n), "prompt_tokens": float(plen.sum()),
             "eos_stops": float(sum(r.eos for b, r in enumerate(rows) if done[b // G])),
             "partial_pending": float(n - int(trained.sum())), "partial_continued": float(continued),
             "partial_new_tokens": float(new_tokens), "partial_trained_tokens": float(ages.numel()),
             "partial_age_sum": float(ages.sum())}
    return CallResult({"seq": seq, "logp": {"logp": logp, "version": version}}, stats, {})
