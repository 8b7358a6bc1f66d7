"""Autoregressive generation with a KV cache, for any (tp, pp) layout of a ``ParallelModel``.

Prompts are left-padded into one buffer of ``P + max_new_tokens`` slots, so every
row's next token lands in the same slot and one KV cache tensor per layer serves
the batch. Rotary positions come from each row's own token count, and the
attention mask hides the left padding, so a padded row computes what it would
alone.

Each step runs the stages in order: stage 0 embeds, hidden states travel by p2p
to the next stage, the last stage gathers the vocabulary shards of the final
position's logits over tp and samples (``sampling.py``). The sampled tokens and
their log-probs are broadcast from the last stage to all stages of the replica,
so every rank knows which rows finished; finished rows are dropped from the
batch and the caches, so the remaining rows decode at their real batch size.
Pipeline stages run one after another for a batch; micro-batched pipelining of
decoding is not implemented.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Sequence

import torch
import torch.distributed as dist

from realloc.models.batch import token_layout
from realloc.models.llama import KVCache, cache_mask
from realloc.models.pipeline import StageLink
from realloc.models.sampling import GenerationConfig, sample_tokens, sequence_generators
from realloc.models.vocab_parallel import gather_vocab
from realloc.strategy import even_ranges

if TYPE_CHECKING:
    from realloc.models.engine import ParallelModel


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


class _StepRunner:
    """Runs one forward over the pipeline with the caches; returns full-vocab logits of the last slot on the last stage."""

    def __init__(self, model: "ParallelModel") -> None:
        self.model = model
        self.link = StageLink(model.groups, model.device, model.dtype)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, caches: list[KVCache],
                 start: int) -> torch.Tensor | None:
        m, g = self.model, self.model.groups
        b, t = ids.shape
        x = m.stage.embed(ids) if g.is_first_stage else self.link.recv_forward((b, t, m.cfg.hidden_size))
        h = m.stage.run_layers(x, positions, mask, caches, start)
        if not g.is_last_stage:
            self.link.send_forward(h)
            return None
        return gather_vocab(m.stage.head(h[:, -1:]), g.tp_group)[:, 0].float()


@torch.no_grad()
def generate(model: "ParallelModel", prompts: Sequence[Sequence[int]] | Mapping[str, torch.Tensor],
             gconfig: GenerationConfig, seq_ids: Sequence[int] | None = None, n_mbs: int = 1) -> GenerationOutput:
    """Generate for this dp replica's ``prompts`` (lists of token ids, or a padded batch mapping).

    ``seq_ids`` name each prompt for the sampling RNG (default 0..B-1). Give every
    prompt a globally unique id (e.g. its index in the global batch) to get the same
    samples whatever the dp degree. ``n_mbs`` splits the prompts into that many
    contiguous micro-batches generated one after another, so only one micro-batch's
    KV cache is alive at a time; the results do not depend on it.
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
    P = max(r.numel() for r in rows)
    if P + gconfig.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"generate: longest prompt ({P}) + max_new_tokens ({gconfig.max_new_tokens}) exceeds "
                         f"max_position_embeddings ({cfg.max_position_embeddings}) of {cfg.name!r}")
    outs = [_generate_batch(model, rows[lo:hi], seq_ids[lo:hi], gconfig) for lo, hi in even_ranges(bsz, n_mbs)]
    return outs[0] if n_mbs == 1 else _concat(outs, gconfig.pad_token_id)


def _concat(outs: list[GenerationOutput], pad: int) -> GenerationOutput:
    width = max(o.sequences.shape[1] for o in outs)

    def widen(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

    return GenerationOutput(torch.cat([widen(o.sequences, pad) for o in outs]),
                            torch.cat([o.lengths for o in outs]), torch.cat([o.prompt_lengths for o in outs]),
                            torch.cat([widen(o.logprobs, 0.0) for o in outs]),
                            torch.cat([o.stopped_at_eos for o in outs]))


def _generate_batch(model: "ParallelModel", rows: list[torch.Tensor], seq_ids: list[int],
                    gconfig: GenerationConfig) -> GenerationOutput:
    g, dev = model.groups, model.device
    bsz = len(rows)
    plen = torch.tensor([r.numel() for r in rows], dtype=torch.long)
    P, N = int(plen.max()), gconfig.max_new_tokens
    total = P + N

    tokens = torch.full((bsz, P), gconfig.pad_token_id, dtype=torch.long)
    key_valid = torch.zeros((bsz, total), dtype=torch.bool)
    for b, r in enumerate(rows):
        tokens[b, P - r.numel():] = r
        key_valid[b, P - r.numel():P] = True
    tokens, key_valid, plen_d = tokens.to(dev), key_valid.to(dev), plen.to(dev)
    positions = ((key_valid[:, :P].long().cumsum(-1) - 1).clamp(min=0))

    model.stage.eval()
    run = _StepRunner(model)
    caches = model.stage.new_kv_caches(bsz, total)
    generators = sequence_generators(gconfig.seed, seq_ids)
    eos = torch.tensor(gconfig.eos_token_ids, dtype=torch.long, device=dev)
    out_tok = torch.full((bsz, N), gconfig.pad_token_id, dtype=torch.long, device=dev)
    out_lp = torch.zeros((bsz, N), dtype=torch.float32, device=dev)
    gen_len = torch.zeros(bsz, dtype=torch.long, device=dev)
    hit_eos = torch.zeros(bsz, dtype=torch.bool, device=dev)
    active = torch.arange(bsz, device=dev)  # rows still decoding, in cache order

    logits = run(tokens, positions, cache_mask(key_valid[:, :P], 0, P), caches, 0)
    for t in range(N):
        # The last stage samples; everyone learns the tokens (stage 0 embeds them, all stages prune rows).
        msg = torch.empty((2, active.numel()), dtype=torch.float64, device=dev)
        if g.is_last_stage:
            ban = eos if t < gconfig.min_new_tokens else None
            tok, lp = sample_tokens(logits, gconfig, [generators[i] for i in active.tolist()], ban)
            msg[0], msg[1] = tok.double(), lp.double()
        if g.pp > 1:
            dist.broadcast(msg, src=g.last_stage_rank, group=g.pp_group)
            run.link.wait_sends()
        tok, lp = msg[0].long(), msg[1].float()
        out_tok[active, t] = tok
        out_lp[active, t] = lp
        gen_len[active] = t + 1
        stop = torch.isin(tok, eos) if eos.numel() else torch.zeros_like(tok, dtype=torch.bool)
        hit_eos[active] = stop
        if t == N - 1:
            break
        keep = ~stop
        if not bool(keep.any()):
            break
        if not bool(keep.all()):
            active, tok = active[keep], tok[keep]
            caches = [KVCache(c.k[keep], c.v[keep]) for c in caches]
        slot = P + t
        key_valid[active, slot] = True
        pos = (plen_d[active] + t).view(-1, 1)
        logits = run(tok.view(-1, 1), pos, cache_mask(key_valid[active, :slot + 1], slot, 1), caches, slot)
    run.link.wait_sends()

    lengths = plen_d + gen_len
    width = int(lengths.max())
    seqs = torch.full((bsz, width), gconfig.pad_token_id, dtype=torch.long, device=dev)
    lps = torch.zeros((bsz, width), dtype=torch.float32, device=dev)
    for b in range(bsz):
        p, n = int(plen[b]), int(gen_len[b])
        seqs[b, :p] = rows[b].to(dev)
        seqs[b, p:p + n] = out_tok[b, :n]
        lps[b, p:p + n] = out_lp[b, :n]
    return GenerationOutput(seqs, lengths, plen_d, lps, hit_eos)
