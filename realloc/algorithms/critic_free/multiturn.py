"""Multi-turn rollouts as a GENERATE interface: the policy and an environment take turns in one sequence.

A rollout is its prompt, then the environment's first observation, then turns: the policy samples until EOS (or
``turn_tokens``), the environment (``realloc/envs/base.py``: ``reset``/``step``) answers with an observation, and
so on until it is done, the turn limit or the token budget (``gen_len``, observations included). Everything after
the prompt is the response of the ``seq`` key (``common.py``): ``gen_mask`` covers the whole conversation (so every
forward pass sees it), and ``seq["loss_mask"]`` [n, T] marks the policy's own tokens. The train steps learn from
``common.loss_mask(seq)``, so environment tokens get zero weight, and their log-probs are 0 in ``logp`` (this call)
and ``ref_logp`` (``policy_logprobs``), so none is ever used. The call also writes the rollout's reward (the sum
of its turns' rewards) under ``rewards``, as a reward call would.

Layout invariance: each turn is one ``generate`` over the still-running rollouts with their conversation so far
as the prompt, seeded per (iteration, turn) and per sequence's global index, so the tokens depend neither on
dp, tp, pp nor the micro-batches. Rows with less budget left than the turn's cap keep only their budget's prefix
(a prefix of a sampled sequence is what a shorter generation draws). The environments run on the replica's
reporting rank (tp rank 0 of the last stage), which broadcasts their observations, rewards and ends to the other
ranks, so a tool runs once per rollout whatever the layout.

``TurnRollouts`` is the call one turn at a time (the interface's ``stepwise`` form): a plan that streams the call's
finished rollouts (a stream-only ``tail`` entry, runtime/control/worker_stream.py) hands them on at its split points
while the others keep taking turns, with the very turns of the plain call.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from realloc.algorithms.common import actor_logprobs, generation_config, loss_mask
from realloc.algorithms.context import CallContext, CallResult, Data
from realloc.envs.base import Environment, check_env, check_step, check_text, env_factory
from realloc.envs.observation_cut import cut_observation
from realloc.envs.rollout_args import rollout_args
from realloc.envs.tool_health import InfraWatch
from realloc.models.engine import ParallelModel
from realloc.models.turn_cache import TurnCache
from realloc.models.weights import param_seed

FAILED = -1  # the broadcast header of a turn whose environment raised on the reporting rank
# The environment's wall seconds and steps, apart for steps that answer (tool calls) and steps that end a rollout:
# the GENERATE call's stats, read back by the planner (envs/turn_profile.py: turns_from_run); with each turn's
# seconds of generation and of the environment (turn<k>_generate_s, turn<k>_env_s)
CLOCK = ("env_obs_s", "env_obs_steps", "env_final_s", "env_final_steps")


@dataclasses.dataclass
class Rollout:
    prompt: list[int]
    budget: int  # response tokens it may still add (policy and environment)
    tokens: list[int] = dataclasses.field(default_factory=list)  # the response: every token after the prompt
    policy: list[bool] = dataclasses.field(default_factory=list)  # token sampled by the policy
    logp: list[float] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    ended_by_env: bool = False

    def add(self, tokens: Sequence[int], logp: Sequence[float] | None) -> None:
        tokens = list(tokens)[:self.budget]
        self.tokens += tokens
        self.policy += [logp is not None] * len(tokens)
        self.logp += list(logp)[:len(tokens)] if logp is not None else [0.0] * len(tokens)
        self.budget -= len(tokens)


def multiturn_generate(ctx: CallContext, inputs: Data) -> CallResult:
    rollouts = TurnRollouts(ctx, inputs)
    try:
        rollouts.finish()
    finally:
        rollouts.pool.shutdown()
    return rollouts.result(list(range(rollouts.n)))


class TurnRollouts:
    """One replica's rollouts of a multi-turn GENERATE call, run one turn at a time: ``multiturn_generate`` runs
    every turn and reports all rows; a call that streams its finished rollouts (a stream-only ``tail`` entry,
    ``runtime/control/worker_stream.py``) runs turns to each split point (``until``), reports the rollouts finished
    by then (``result``) and ``finish``es the rest later. A turn is the same ``generate`` over the same running
    rollouts either way (seeded per turn and row), so streamed rollouts are the plain ones token for token."""

    def __init__(self, ctx: CallContext, inputs: Data) -> None:
        model, tok = ctx.model, ctx.tokenizer
        assert model is not None
        self.ctx, self.where = ctx, f"call {ctx.call.name!r}"
        self.args = args = rollout_args(ctx.call.name, ctx.call.interface_args)
        if tok is None:
            raise ValueError(f"{self.where}: a multi-turn rollout decodes the policy's turns and encodes "
                             f"observations; the experiment needs a tokenizer")
        self.prompts = prompts = inputs["prompts"]
        plen = prompts["lengths"]
        self.n, T = plen.shape[0], ctx.gen_len
        self.rolls = [Rollout(prompts["tokens"][b, :int(plen[b])].tolist(), T) for b in range(self.n)]
        self.lead = _leaders(ctx, self.n)
        self.runs = sorted(set(self.lead))  # the rollouts that run (greedy: one per prompt)
        self.reporter = model.groups.tp_rank == 0 and model.groups.is_last_stage
        self.envs: dict[int, Environment] = {}
        first: list[list[int]] | BaseException | None = None
        if self.reporter:
            try:
                make = env_factory(self.where, args.env)
                rows = prompts["rows"].tolist() if "rows" in prompts and ctx.records is not None else [None] * self.n
                self.envs = {b: check_env(self.where, args.env, make(**args.env_args)) for b in self.runs}
                first = [_encode(tok, cut_observation(tok, _first_observation(
                    self.where, self.envs[b], {} if rows[b] is None else dict(ctx.records(int(rows[b])))), T))
                    for b in self.runs]
            except Exception as e:  # noqa: BLE001  (re-raised on every rank by _share_tokens)
                first = e
        for b, obs in zip(self.runs, _share_tokens(model, first)):
            self.rolls[b].add(obs, None)
        # the environment's steps, timed on the reporting rank (the planner reads it); ``reported``: what earlier
        # results of a streamed call reported already (each reports what came since)
        self.clock = dict.fromkeys(CLOCK, 0.0)
        self.reported: dict[str, float] = {}
        self.base = generation_config(ctx)
        self.cap = min(args.turn_tokens or T, T)
        self.cache = TurnCache() if args.kv_cache else None  # each rollout's keys and values, kept across turns
        if self.cache is not None:  # prompt tokens run through the model, and those taken from the kept caches
            self.clock.update(prefill_tokens=0.0, cached_tokens=0.0)
        self.turn = 0  # the next turn
        self.pool = ThreadPoolExecutor(max_workers=args.env_workers)
        self.left = -1  # the whole call's running rollouts after the last turn (streamed; -1: no turn yet)
        self.infra = InfraWatch()  # stops the call where every tool call fails to start (envs/tool_health.py)

    def _active(self) -> list[int]:
        return [b for b in self.runs if not self.rolls[b].done and self.rolls[b].budget > 0]

    def running(self) -> list[int]:
        """Local positions of the rows still taking turns (a row copying a leader runs while its leader does)."""
        active = set(self._active()) if self.turn < self.args.max_turns else set()
        return [b for b in range(self.n) if self.lead[b] in active]

    def _step(self) -> None:
        """Turn ``self.turn`` of the running rollouts (none left: only the turn counter moves)."""
        ctx, args, rolls, turn = self.ctx, self.args, self.rolls, self.turn
        self.turn += 1
        if turn >= args.max_turns:
            return
        active = self._active()
        if self.cache is not None:
            self.cache.drop([ctx.ids[b] for b in self.runs if b not in active])
        if not active:
            return
        new = min(self.cap, max(rolls[b].budget for b in active))
        gconfig = dataclasses.replace(self.base, max_new_tokens=new, min_new_tokens=min(self.base.min_new_tokens, new),
                                      seed=param_seed(ctx.seed, f"{ctx.purpose}/{ctx.iteration}/turn{turn}"))
        t0 = time.perf_counter()
        assert ctx.model is not None
        out = ctx.model.generate([rolls[b].prompt + rolls[b].tokens for b in active], gconfig,
                                 seq_ids=[ctx.ids[b] for b in active], n_mbs=min(ctx.n_mbs, len(active)),
                                 turn_cache=self.cache)
        t1 = time.perf_counter()
        said: list[list[int]] = []
        for i, b in enumerate(active):
            start, g = int(out.prompt_lengths[i]), int(out.gen_lengths[i])
            said.append(out.sequences[i, start:start + g].tolist()[:rolls[b].budget])
            rolls[b].add(said[-1], out.logprobs[i, start:start + g].tolist())
            rolls[b].turns += 1
        answers = None
        if self.reporter:
            tok = ctx.tokenizer
            envs = [self.envs[b] for b in active]
            before = self.infra.counts(envs)
            answers = _steps(self.where, self.pool, envs, [tok.decode(s) for s in said], self.clock)
            if not isinstance(answers, BaseException):
                # cut before the broadcast and the tokenizer: a 100 MB observation costs the budget's window only
                answers = [(None if obs is None else cut_observation(tok, obs, rolls[b].budget), reward, done)
                           for b, (obs, reward, done) in zip(active, answers)]
                try:
                    self.infra.turn(self.where, envs, before)
                except RuntimeError as e:  # re-raised on every rank by _share_answers
                    answers = e
        last = turn == args.max_turns - 1
        for b, (obs, reward, done) in zip(active, _share_answers(ctx.model, answers, len(active))):
            r = rolls[b]
            r.reward += reward
            r.ended_by_env = done or obs is None
            r.done = r.ended_by_env or last
            if not r.done:
                r.add(_encode(ctx.tokenizer, obs), None)
        # the turn's wall seconds (the timeline draws them, search/turns_report.py)
        self.clock[f"turn{turn + 1}_generate_s"] = t1 - t0
        self.clock[f"turn{turn + 1}_env_s"] = time.perf_counter() - t1
        if self.cache is not None:
            self.clock.update(prefill_tokens=float(self.cache.prefilled), cached_tokens=float(self.cache.reused))

    def until(self, global_count: Callable[[int], int], threshold: int) -> bool:
        """Take turns to the split point, the first turn after which at most ``threshold`` rollouts of the whole
        call are running (``global_count(local)`` sums them over the dp replicas, called once per turn on every
        replica); False if the call ended first. A later split point that an earlier turn passed takes no turn."""
        while self.left < 0 or self.left > threshold:
            self._step()
            self.left = global_count(len(self.running()))
        return self.left > 0

    def finish(self) -> None:
        """Take the running rollouts' remaining turns."""
        while self.running():
            self._step()
        if self.cache is not None:
            self.cache.drop([self.ctx.ids[b] for b in self.runs])
        self.pool.shutdown()

    def result(self, positions: Sequence[int]) -> CallResult:
        """The rows at local ``positions`` (finished), with the clock's seconds since the last result."""
        clock = {k: v - self.reported.get(k, 0.0) for k, v in self.clock.items()}
        self.reported = dict(self.clock)
        idx = torch.tensor(list(positions), dtype=torch.long)
        prompts = {k: v.index_select(0, idx) for k, v in self.prompts.items()}
        envs = [self.envs[b] for b in positions if b in self.envs]
        return _result(self.ctx, [self.rolls[self.lead[b]] for b in positions], prompts, envs, clock,
                       self.reporter)


def _leaders(ctx: CallContext, n: int) -> list[int]:
    """The rollout each row copies: itself, or under greedy decoding (evaluation) the first row of its prompt's
    group, since every row of a group would say the same. The environment is then stepped once per prompt; an
    environment whose answers are random would have answered each row differently, which an evaluation of the
    policy does not need."""
    if not ctx.greedy or ctx.group_size <= 1:
        return list(range(n))
    first: dict[int, int] = {}
    return [first.setdefault(ctx.ids[b] // ctx.group_size, b) for b in range(n)]


def _first_observation(where: str, env: Environment, record: dict[str, Any]) -> str:
    return check_text(where, "the environment's reset() (the first observation; '' for none)", env.reset(record))


def _encode(tok: Any, text: str | None) -> list[int]:
    return tok.encode(text, add_special_tokens=False) if text else []


def _timed_step(env: Environment, text: str) -> tuple[Any, float]:
    t0 = time.perf_counter()
    got = env.step(text)
    return got, time.perf_counter() - t0


def _steps(where: str, pool: ThreadPoolExecutor, envs: list[Environment], texts: list[str],
           clock: dict[str, float]) -> list[tuple[str | None, float, bool]] | BaseException:
    """Each environment's answer to its rollout's turn, or the first error raised. ``clock`` adds up the steps'
    wall seconds, those that answer with an observation (tool calls) apart from those that end the rollout."""
    try:
        out = []
        for got, seconds in pool.map(_timed_step, envs, texts):
            obs, reward, done = check_step(where, got)
            kind = "final" if done or obs is None else "obs"
            clock[f"env_{kind}_s"] += seconds
            clock[f"env_{kind}_steps"] += 1
            out.append((obs, reward, done))
        return out
    except Exception as e:  # noqa: BLE001  (re-raised on every rank by _share_answers)
        return e


def _result(ctx: CallContext, rolls: list[Rollout], prompts: dict[str, torch.Tensor], envs: list[Environment],
            clock: dict[str, float], reporter: bool) -> CallResult:
    n, P, T = len(rolls), ctx.prompt_len, ctx.gen_len
    tokens = torch.full((n, P + T), ctx.pad_token_id, dtype=torch.long)
    gen_mask = torch.zeros(n, T, dtype=torch.bool)
    policy = torch.zeros(n, T, dtype=torch.bool)
    logp = torch.zeros(n, T, dtype=torch.float32)
    plen = prompts["lengths"].clone()
    for b, r in enumerate(rolls):
        p, k = len(r.prompt), len(r.tokens)
        tokens[b, :p + k] = torch.tensor(r.prompt + r.tokens, dtype=torch.long)
        gen_mask[b, :k] = True
        policy[b, :k] = torch.tensor(r.policy, dtype=torch.bool)
        logp[b, :k] = torch.tensor(r.logp, dtype=torch.float32) * policy[b, :k]
    seq = {"tokens": tokens, "prompt_lens": plen, "gen_mask": gen_mask, "loss_mask": policy}
    if "rows" in prompts:
        seq["rows"] = prompts["rows"].clone()
    score = torch.tensor([r.reward for r in rolls], dtype=torch.float32)
    stats = {"gen_tokens": float(gen_mask.sum()), "n_seqs": float(n), "prompt_tokens": float(plen.sum()),
             # a rollout the environment ended (not the turn limit or the budget) counts as stopped
             "eos_stops": float(sum(r.ended_by_env for r in rolls)),
             "policy_tokens": float(policy.sum()), "env_tokens": float((gen_mask & ~policy).sum()),
             "turns": float(sum(r.turns for r in rolls))}
    if reporter:  # the reporting rank's: the master reads its stats
        stats.update(clock)
    for e in envs:  # tool outcomes, counted on the reporting rank (the one whose stats the master reads)
        for status, c in getattr(e, "tool_counts", {}).items():
            stats[f"tool_{status}"] = stats.get(f"tool_{status}", 0.0) + float(c)
    return CallResult({"seq": seq, "logp": {"logp": logp}, "rewards": {"score": score}}, stats, {})


def policy_logprobs(ctx: CallContext, inputs: Data) -> CallResult:
    """The actor's (or the reference's) log-probs of the policy's tokens; 0 on the environment's."""
    out = actor_logprobs(ctx, inputs)
    if "logp" in out.outputs:
        out.outputs["logp"]["logp"] = out.outputs["logp"]["logp"] * loss_mask(inputs["seq"])
    return out


# -- sharing the reporting rank's answers with the replica's other ranks ----------------------------------------
def _broadcast(values: list[int] | None, model: ParallelModel) -> list[int]:
    """``values`` of the reporting rank (tp 0 of the last stage) on every rank of its replica."""
    g = model.groups
    if g.tp > 1 and g.is_last_stage:
        values = _broadcast_in(values, g.tp_ranks[0], g.tp_group, model.device)
    if g.pp > 1:
        values = _broadcast_in(values, g.pp_ranks[-1], g.pp_group, model.device)
    assert values is not None
    return values


def _broadcast_in(values: list[int] | None, src: int, group: Any, device: torch.device) -> list[int]:
    size = torch.tensor([len(values) if values is not None else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = (torch.tensor(values, dtype=torch.long, device=device) if values is not None
           else torch.empty(int(size), dtype=torch.long, device=device))
    dist.broadcast(buf, src=src, group=group)
    return buf.cpu().tolist()


def _raise_everywhere(flat: list[int], mine: Any) -> None:
    """An environment's error on the reporting rank (``FAILED`` header) raised on every rank of the replica."""
    if flat[0] != FAILED:
        return
    if isinstance(mine, BaseException):
        raise mine
    raise ValueError("the environment raised on the replica's reporting rank (tp 0 of the last stage); see that "
                     "rank's error")


def _share_tokens(model: ParallelModel, rows: list[list[int]] | BaseException | None) -> list[list[int]]:
    flat = None
    if isinstance(rows, BaseException):
        flat = [FAILED]
    elif rows is not None:
        flat = [len(rows)] + [x for r in rows for x in [len(r), *r]]
    flat = _broadcast(flat, model)
    _raise_everywhere(flat, rows)
    out, i = [], 1
    for _ in range(flat[0]):
        k = flat[i]
        out.append(flat[i + 1:i + 1 + k])
        i += 1 + k
    return out


def _share_answers(model: ParallelModel, answers: Any, n: int) -> list[tuple[str | None, float, bool]]:
    """(observation, reward, done) per active rollout on every rank; an environment's error raises everywhere."""
    flat = None
    if answers is not None:
        if isinstance(answers, BaseException):
            flat = [FAILED]
        else:
            flat = [n]
            for obs, reward, done in answers:
                data = list(obs.encode("utf-8")) if obs is not None else []
                bits = int(torch.tensor([reward], dtype=torch.float64).view(torch.int64)[0])
                flat += [bits, int(done), int(obs is None), len(data), *data]
    flat = _broadcast(flat, model)
    _raise_everywhere(flat, answers)
    out, i = [], 1
    for _ in range(flat[0]):
        bits, done, none, k = flat[i:i + 4]
        reward = float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)[0])
        text = None if none else bytes(flat[i + 4:i + 4 + k]).decode("utf-8")
        out.append((text, reward, bool(done)))
        i += 4 + k
    return out
