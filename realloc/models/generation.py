"""Autoregressive generation with a KV cache, for any (tp, pp) layout of a ``ParallelModel``.

It needs only a ``DecodingModel`` (a model's shape, groups, device and pipeline stage), so ``engine.py``
can call it without a circle of imports. Generation runs without sequence parallelism (``sequence_parallel.py``):
prefill and decoding keep every token on every tp rank, as the KV cache and the one-token decode steps need.

Prompts are left-padded into one buffer of ``P + max_new_tokens`` slots, so every
row's next token lands in the same slot and one KV cache tensor per layer serves
the batch. Rotary positions come from each row's own token count, and the
attention mask hides the left padding, so a padded row computes what it would
alone.

The prompts split into ``n_mbs`` contiguous micro-batches, each with its own KV
cache. A micro-batch's step runs the stages in order: stage 0 embeds, hidden
states travel by p2p to the next stage, the last stage gathers the vocabulary
shards of the final position's logits over tp and samples (``sampling.py``) and
sends the tokens and their log-probs to every other stage of the replica, so
every rank knows which rows finished; finished rows are dropped from the
micro-batch and its caches, so the remaining rows decode at their real batch
size, and a micro-batch whose rows all finished leaves.

With pp = 1 the micro-batches generate one after another (one KV cache alive at
a time). With pp > 1 they are pipelined (realhf.txt §2): every stage walks the
same order of work, rounds r = 0, 1, ... and in each round the micro-batches in
flight in index order, each through this stage's part of its next step, so stage
k works on micro-batch i while stage k + 1 works on micro-batch i - 1. A stage
needs micro-batch i's tokens of step t before its step t + 1 (stage 0 to embed
them, every stage to drop finished rows); with pp micro-batches in flight they
are back one token trip after they are needed.

At most ``max_in_flight`` micro-batches (default pp) hold a KV cache at once, as
ReaLHF keeps only the micro-batches the pipeline needs: a micro-batch starts (its
prefill) in the first round that finds a free place, and a place frees when a
micro-batch has finished. Every stage must start the same micro-batch in the same
round, but the last stage learns that micro-batch j finished after step f in round
f and the others in round f + 1; so the rule for round r counts only finishes of
step r - 2 or earlier, which every stage knows when round r begins. With equal
generation lengths that makes waves of ``max_in_flight`` micro-batches
(``estimator/call_time.py`` prices them so). Every micro-batch computes exactly
what it would alone, so the tokens depend neither on pp nor on the schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from realloc.models.batch import token_layout
from realloc.models.length_schedule import force_lengths, scheduled_lengths
from realloc.models.llama import KVCache, cache_mask
from realloc.models.sampling import GenerationConfig, draw_uniforms, sample_from_uniforms, sequence_generators
# DecodingModel: what generation reads of a model, defined beside the static step that reads it too
from realloc.models.static_decode import (DecodingModel, StaticDecoder, decode_static, wants_graph,
                                          wants_static_op_by_op)
from realloc.models.turn_cache import TurnCache, restore
from realloc.models.vocab_parallel import gather_vocab
from realloc.strategy import even_ranges


@dataclasses.dataclass
class GenerationOutput:
    """Results for this dp replica's prompts, identical on every rank of the replica.

    ``sequences[b, :lengths[b]]`` is the prompt followed by the generated tokens
    (including the EOS token if one was produced), right-padded with the pad id.
    ``logprobs`` is aligned with ``sequences``: the log-prob of each generated token,
    0 on prompt tokens and padding (the ``forward()`` convention, restricted to the answer).
    """

    sequences: torch.Tensor  # [B, L] long
    lengths: torch.Tensor  # [B] long
    prompt_lengths: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B, L] float32
    stopped_at_eos: torch.Tensor  # [B] bool; False: cut at max_new_tokens

    @property
    def gen_lengths(self) -> torch.Tensor:
        return self.lengths - self.prompt_lengths


def _prompt_list(prompts: Sequence[Sequence[int]] | Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(prompts, Mapping):
        lay = token_layout(prompts, "generate prompts")
        rows = []
        for ids, seg in zip(lay.input_ids, lay.segment_ids):
            rows.append(ids[seg >= 0].cpu())
        return rows
    return [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]


# Tags of generation's point-to-point messages (pipeline.py uses 11 and 12 for training).
HIDDEN_TAG = 21
TOKENS_TAG = 22


class _Wire:
    """Point-to-point traffic of one stage during generation, on the model's pp group.

    On gloo a send is posted at once and waited only once its receiver has provably taken it,
    i.e. after this stage received a message that causally follows that receive (``settle``), so
    no stage blocks on a send. On NCCL p2p runs as kernels in stream order, so a send waiting for
    its receiver could block a receive its receiver waits for: sends are held back and posted in
    one ``batch_isend_irecv`` with this stage's next receive (as 1F1B does; not exercised by the
    CPU test suite).
    """

    def __init__(self, model: DecodingModel) -> None:
        self.group = model.groups.pp_group
        self.device = model.device
        self.batched = dist.get_backend(self.group) == "nccl"
        self.outbox: list[tuple[torch.Tensor, int, int]] = []  # NCCL: held back until the next receive
        self.posted: dict[int, list[tuple[dist.Work, torch.Tensor]]] = {}  # gloo: posted sends by micro-batch

    def send(self, tensor: torch.Tensor, dst: int, tag: int, mb: int) -> None:
        t = tensor.detach().contiguous()
        if self.batched:
            self.outbox.append((t, dst, tag))
        else:
            self.posted.setdefault(mb, []).append((dist.isend(t, dst=dst, group=self.group, tag=tag), t))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        if not self.batched:
            dist.irecv(buf, src=src, group=self.group, tag=tag).wait()
            return buf
        ops = [dist.P2POp(dist.isend, t, dst, self.group, tag) for t, dst, tag in self.outbox]
        ops.append(dist.P2POp(dist.irecv, buf, src, self.group, tag))
        self.outbox.clear()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return buf

    def settle(self, mb: int) -> None:
        """Wait for the sends of micro-batch ``mb``'s previous step: this stage has just received the
        message of its next step, which no stage sends before every message of the previous step arrived."""
        for work, _ in self.posted.pop(mb, ()):
            work.wait()

    def finish(self) -> None:
        if self.outbox:
            ops = [dist.P2POp(dist.isend, t, dst, self.group, tag) for t, dst, tag in self.outbox]
            self.outbox.clear()
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for mb in list(self.posted):
            self.settle(mb)


def drop_rows(caches: list[KVCache], keep: torch.Tensor, used: int | None = None) -> list[KVCache]:
    """The caches of the rows ``keep`` marks, compacted in place to the front of each layer's buffer: only the
    slots [0, ``used``) that steps wrote so far move (default: all), the later ones are written before any step
    reads them. A copy of every row's whole cache into new tensors cost 1.5-1.7 ms per finish of rows at 64 rows
    of 160 slots (estimator: its cost per finish of rows, ``engine.row_drop``, timed by the profiler on this
    function)."""
    idx = keep.nonzero().flatten()
    n = idx.numel()
    out = []
    moved: dict[int, torch.Tensor] = {}  # a sliding window's slot positions, one tensor the layers may share
    for c in caches:
        end = c.k.shape[2] if used is None else used
        c.k[:n, :, :end] = c.k[idx, :, :end]  # the right side is a gathered copy: rows move only forward
        c.v[:n, :, :end] = c.v[idx, :, :end]
        if c.pos is not None and id(c.pos) not in moved:  # moved once, however many layers hold it
            c.pos[:n, :end] = c.pos[idx, :end]
            moved[id(c.pos)] = c.pos[:n]
        out.append(KVCache(c.k[:n], c.v[:n], None if c.pos is None else moved[id(c.pos)]))
    return out


class _MicroBatch:
    """One micro-batch's prompts, KV caches, RNG streams and generated tokens on this rank."""

    def __init__(self, model: DecodingModel, rows: list[torch.Tensor], seq_ids: list[int],
                 gconfig: GenerationConfig, turn_cache: TurnCache | None = None) -> None:
        dev = model.device
        self.model, self.rows, self.gconfig = model, rows, gconfig
        bsz = len(rows)
        self.plen = torch.tensor([r.numel() for r in rows], dtype=torch.long)
        # Rows kept from an earlier turn (turn_cache.py): their kept prefix fills slots [C - c, C) and only the
        # rest is prefilled, left-padded into [C, P). Without kept rows C = 0: the whole left-padded prompt.
        self.seq_ids, self.turn_cache = seq_ids, turn_cache
        self.kept = [None if turn_cache is None else turn_cache.take(i, r) for i, r in zip(seq_ids, rows)]
        cached = [0 if k is None else k.length for k in self.kept]
        C, W = max(cached), max(r.numel() - c for r, c in zip(rows, cached))
        self.C, self.P, self.N = C, C + W, gconfig.max_new_tokens
        tokens = torch.full((bsz, W), gconfig.pad_token_id, dtype=torch.long)
        key_valid = torch.zeros((bsz, self.P + self.N), dtype=torch.bool)
        for b, (r, c) in enumerate(zip(rows, cached)):
            tokens[b, W - (r.numel() - c):] = r[c:]
            key_valid[b, C - c:C] = True
            key_valid[b, self.P - (r.numel() - c):self.P] = True
        self.key_valid, self.plen_d = key_valid.to(dev), self.plen.to(dev)
        # Every row's draws for all N steps at once: a row draws once per step until it stops, so its draw at step
        # t is its generator's t-th, which a vector draw yields too (draw_uniforms); one call per row, not per step.
        self.uniforms = (None if gconfig.greedy else
                         draw_uniforms(sequence_generators(gconfig.seed, seq_ids), self.N).to(dev))
        # length_schedule: each row's response length, where its EOS is forced (length_schedule.py)
        self.target = (torch.tensor(scheduled_lengths(gconfig.length_schedule, gconfig.max_new_tokens, gconfig.seed,
                                                      seq_ids), dtype=torch.long, device=dev)
                       if gconfig.length_schedule is not None else None)
        self.eos = torch.tensor(gconfig.eos_token_ids, dtype=torch.long, device=dev)
        self.out_tok = torch.full((bsz, self.N), gconfig.pad_token_id, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros((bsz, self.N), dtype=torch.float32, device=dev)
        self.gen_len = torch.zeros(bsz, dtype=torch.long, device=dev)
        self.hit_eos = torch.zeros(bsz, dtype=torch.bool, device=dev)
        self.active = torch.arange(bsz, device=dev)  # rows still decoding, in cache order
        self.prompts: torch.Tensor | None = None  # [rows, longest prompt], right-padded (output)
        self.caches: list[KVCache] = []
        self.done = False
        self.finished_step = -1  # the step (of this micro-batch) whose tokens finished it
        # the next step's inputs: the whole left-padded prompt first
        tokens = tokens.to(dev)
        positions = (self.key_valid[:, :self.P].long().cumsum(-1) - 1).clamp(min=0)[:, C:]
        # the prefill's [rows, 1, W, P] left-padding mask is built by its first forward, not here: every micro-batch
        # is made up front, and theirs would all be alive at once (estimator/mask_memory.py counts one per in flight)
        self.inputs = (tokens, positions, None, C)

    @property
    def n_active(self) -> int:
        return self.active.numel()

    def forward(self, x: torch.Tensor | None, t: int) -> torch.Tensor:
        """This stage's part of step ``t``: hidden states out, or on the last stage the logits of the
        last slot (the full, unpadded vocabulary, float32)."""
        m, g = self.model, self.model.groups
        ids, positions, mask, start = self.inputs
        if mask is None:  # the prefill (t == 0)
            mask = cache_mask(self.key_valid[:, :self.P], start, ids.shape[1])
        if t == 0:
            # slots [C, P + N) are written (prefill, then one per step) before a step reads them; [0, C) is
            # restored for kept rows and read, masked, for the others: zeros there
            self.caches = m.stage.new_kv_caches(ids.shape[0], self.P + self.N, zeroed=self.C)
            restore(self.caches, self.kept, self.C)
            self.kept = []  # in the caches now
        h = m.stage.embed(ids) if g.is_first_stage else x
        h = m.stage.run_layers(h, positions, mask, self.caches, start)
        if not g.is_last_stage:
            return h
        # The real vocabulary only: a padding id can never be drawn, with or without a tokenizer's vocab_limit.
        return gather_vocab(m.stage.head(h[:, -1:]), g.tp_group)[:, 0, :m.cfg.vocab_size].float()

    def sample(self, logits: torch.Tensor, t: int) -> torch.Tensor:
        """The last stage's draw for step ``t``: [2, rows] float64 (tokens, log-probs)."""
        # a scheduled row ends only where its schedule says: EOS is banned until force_lengths places it
        scheduled = self.target is not None and self.eos.numel() > 0
        ban = self.eos if scheduled or t < self.gconfig.min_new_tokens else None
        u = None if self.uniforms is None else self.uniforms[self.active, t]
        tok, lp = sample_from_uniforms(logits, self.gconfig, u, ban)
        if scheduled:
            tok, lp = force_lengths(logits, tok, self.target[self.active] == t + 1, self.eos,
                                    self.gconfig.temperature)
        return torch.stack([tok.double(), lp.double()])

    def apply(self, msg: torch.Tensor, t: int) -> None:
        """Record step ``t``'s tokens; drop finished rows and prepare step t + 1's inputs (or finish)."""
        tok, lp = msg[0].long(), msg[1].float()
        active = self.active
        self.out_tok[active, t] = tok
        self.out_lp[active, t] = lp
        self.gen_len[active] = t + 1
        stop = torch.isin(tok, self.eos) if self.eos.numel() else torch.zeros_like(tok, dtype=torch.bool)
        self.hit_eos[active] = stop
        if self.target is not None:  # a scheduled row ends at its length, with EOS where there is one
            stop = stop | (self.target[active] == t + 1)
        keep = ~stop
        if self.turn_cache is not None:  # the finished rows' caches, for their next turn
            self._keep_finished(active, stop if t < self.N - 1 else torch.ones_like(stop), t)
        if t == self.N - 1 or not bool(keep.any()):
            self.done, self.caches, self.finished_step = True, [], t
            return
        if not bool(keep.all()):
            self.active, tok = active[keep], tok[keep]
            self.caches = drop_rows(self.caches, keep, self.P + t)  # steps 0..t wrote slots [0, P + t)
        slot = self.P + t
        self.key_valid[self.active, slot] = True
        pos = (self.plen_d[self.active] + t).view(-1, 1)
        self.inputs = (tok.view(-1, 1), pos, cache_mask(self.key_valid[self.active, :slot + 1], slot, 1), slot)

    def _keep_finished(self, active: torch.Tensor, finished: torch.Tensor, t: int) -> None:
        """Hand the rows that finish at step ``t`` to the turn cache: their keys and values in the cache slots
        [0, P + t) (every token but the last sampled one, which no step fed in)."""
        assert self.turn_cache is not None
        for i in finished.nonzero().flatten().tolist():
            b = int(active[i])
            tokens = torch.cat([self.rows[b], self.out_tok[b, :t].cpu()])
            slots = self.key_valid[b, :self.P + t].nonzero().flatten()
            self.turn_cache.keep(self.seq_ids[b], tokens, self.caches, i, slots)

    def output(self) -> GenerationOutput:
        if self.prompts is None:  # the prompts right-padded, once (a streamed call asks at every split point)
            self.prompts = torch.nn.utils.rnn.pad_sequence(self.rows, batch_first=True).to(self.model.device)
        seqs, lps = assemble(self.prompts, self.plen_d, self.out_tok, self.out_lp, self.gen_len,
                             self.gconfig.pad_token_id)
        return GenerationOutput(seqs, self.plen_d + self.gen_len, self.plen_d, lps, self.hit_eos)


def assemble(prompts: torch.Tensor, plen: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
             gen_len: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt (``prompts`` [rows, >= its length], right-padded) followed by its ``gen_len`` generated
    ``tokens`` [rows, >= gen_len], right-padded with ``pad`` to the longest row, and the log-probs aligned with
    them (0 on prompt and padding): a few gathers, not a loop over rows (done at every split point of a streamed
    call, and by a migration's freed replicas before they reply)."""
    n, width = plen.numel(), int((plen + gen_len).max()) if plen.numel() else 1
    col = torch.arange(width, device=prompts.device).view(1, -1)
    p, end = plen.view(-1, 1), (plen + gen_len).view(-1, 1)
    at_prompt = col.clamp(max=max(prompts.shape[1] - 1, 0)).expand(n, -1)
    at_gen = (col - p).clamp(0, max(tokens.shape[1] - 1, 0))
    in_gen = (col >= p) & (col < end)
    prompt_part = prompts.gather(1, at_prompt) if prompts.shape[1] else torch.zeros_like(at_prompt)
    seqs = torch.where(in_gen, tokens.gather(1, at_gen), torch.where(col < p, prompt_part, pad))
    return seqs, torch.where(in_gen, logprobs.float().gather(1, at_gen), 0.0)


@torch.no_grad()
def generate(model: DecodingModel, prompts: Sequence[Sequence[int]] | Mapping[str, torch.Tensor],
             gconfig: GenerationConfig, seq_ids: Sequence[int] | None = None, n_mbs: int = 1,
             max_in_flight: int | None = None, turn_cache: TurnCache | None = None) -> GenerationOutput:
    """Generate for this dp replica's ``prompts`` (lists of token ids, or a padded batch mapping).

    ``seq_ids`` name each prompt for the sampling RNG (default 0..B-1). Give every
    prompt a globally unique id (e.g. its index in the global batch) to get the same
    samples whatever the dp degree. ``n_mbs`` splits the prompts into that many
    contiguous micro-batches: generated one after another with pp = 1 (one KV cache
    alive at a time), pipelined through the stages with pp > 1, at most
    ``max_in_flight`` (default pp) at a time; use at least pp micro-batches to keep
    every stage busy. The results depend on neither.

    ``turn_cache`` (``turn_cache.py``, multi-turn rollouts): rows whose earlier turn left their keys and values
    there prefill only the tokens added since, and every row's are kept for its next turn. Eager decoding only;
    the static and graph decoders prefill whole prompts and keep nothing.
    """
    cfg = model.cfg
    if cfg.is_critic:
        raise ValueError(f"generate: model {cfg.name!r} is a critic (scalar head) and cannot generate tokens")
    gconfig.check_vocab(cfg.vocab_size)
    rows = _prompt_list(prompts)
    if not rows:
        raise ValueError("generate: no prompts")
    if any(r.numel() == 0 for r in rows):
        raise ValueError("generate: every prompt needs at least one token")
    bsz = len(rows)
    seq_ids = list(range(bsz)) if seq_ids is None else [int(i) for i in seq_ids]
    if len(seq_ids) != bsz:
        raise ValueError(f"generate: {len(seq_ids)} seq_ids for {bsz} prompts")
    if not 1 <= n_mbs <= bsz:
        raise ValueError(f"generate: n_mbs={n_mbs} must be between 1 and the number of prompts ({bsz})")
    in_flight = model.groups.pp if max_in_flight is None else max_in_flight
    if not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"generate: max_in_flight must be a positive integer, got {max_in_flight!r}")
    P = max(r.numel() for r in rows)
    if P + gconfig.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"generate: longest prompt ({P}) + max_new_tokens ({gconfig.max_new_tokens}) exceeds "
                         f"max_position_embeddings ({cfg.max_position_embeddings}) of {cfg.name!r}")
    if model.stage.training:  # eval() walks every module; the stage is only ever switched as a whole
        model.stage.eval()
    graph = wants_graph(model, gconfig) and gconfig.length_schedule is None  # a schedule decodes eagerly
    static = graph or wants_static_op_by_op(model, gconfig)
    mbs = [_MicroBatch(model, rows[lo:hi], seq_ids[lo:hi], gconfig, None if static else turn_cache)
           for lo, hi in even_ranges(bsz, n_mbs)]
    wire = _Wire(model)
    if static:
        # static shapes, a CUDA graph per (rows, cache length) on a GPU (static_decode.py); freed on return
        decoders: dict[tuple[int, int], StaticDecoder] = {}
        for mb in mbs:
            decode_static(mb, decoders, graph)
        del decoders
    elif model.groups.pp == 1:
        for mb in mbs:  # one after another: only this micro-batch's cache is alive
            t = 0
            while not mb.done:
                mb.apply(mb.sample(mb.forward(None, t), t), t)
                t += 1
    else:
        _pipelined(model, mbs, wire, in_flight)
    wire.finish()
    outs = [mb.output() for mb in mbs]
    return outs[0] if n_mbs == 1 else _concat(outs, gconfig.pad_token_id)


def _pipelined(model: DecodingModel, mbs: list[_MicroBatch], wire: _Wire, max_in_flight: int) -> None:
    """Every stage walks rounds r = 0, 1, ...: the micro-batches in flight, in index order, each through this
    stage's part of its next step; micro-batches start as places free (module docstring)."""
    g = model.groups
    start: list[int] = []  # the round each started micro-batch ran its prefill in
    r = 0
    while len(start) < len(mbs) or not all(mb.done for mb in mbs):
        # Finished by step r - 2: every stage knows it now (the last stage at round f, the others at f + 1).
        busy = sum(1 for i, mb in enumerate(mbs[:len(start)])
                   if not (mb.done and start[i] + mb.finished_step <= r - 2))
        while len(start) < len(mbs) and busy < max_in_flight:
            start.append(r)
            busy += 1
        for i, mb in enumerate(mbs[:len(start)]):
            if mb.done:
                continue
            t = r - start[i]  # this micro-batch's step
            if t > 0 and not g.is_last_stage:
                # the tokens of step t - 1 (the last stage applied them when it sampled them)
                mb.apply(wire.recv((2, mb.n_active), torch.float64, g.last_stage_rank, TOKENS_TAG), t - 1)
                wire.settle(i)  # our hidden states of step t - 1 have arrived
                if mb.done:
                    continue
            stage_pass(model, mb, i, t, wire)
        r += 1


def stage_pass(model: DecodingModel, mb: _MicroBatch, i: int, t: int, wire: _Wire) -> None:
    """This stage's part of micro-batch ``i``'s step ``t``: its hidden states in, this stage's layers, then the hidden
    states on to the next stage, or (the last stage) the step's tokens drawn and sent to every other stage."""
    g = model.groups
    x = None
    if not g.is_first_stage:
        width = mb.inputs[0].shape[1]
        x = wire.recv((mb.n_active, width, model.cfg.hidden_size), model.dtype, g.prev_stage_rank, HIDDEN_TAG)
        if g.is_last_stage:
            wire.settle(i)  # every stage has our tokens of step t - 1
    out = mb.forward(x, t)
    if not g.is_last_stage:
        wire.send(out, g.next_stage_rank, HIDDEN_TAG, i)
        return
    msg = mb.sample(out, t)
    for dst in g.pp_ranks[:-1]:
        wire.send(msg, dst, TOKENS_TAG, i)
    mb.apply(msg, t)


def _concat(outs: list[GenerationOutput], pad: int) -> GenerationOutput:
    width = max(o.sequences.shape[1] for o in outs)

    def widen(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

    return GenerationOutput(torch.cat([widen(o.sequences, pad) for o in outs]),
                            torch.cat([o.lengths for o in outs]), torch.cat([o.prompt_lengths for o in outs]),
                            torch.cat([widen(o.logprobs, 0.0) for o in outs]),
                            torch.cat([o.stopped_at_eos for o in outs]))
