"""Token sampling that depends only on the logits, the seed and each sequence's id.

Each sequence draws its uniform numbers from its own generator seeded by
(seed, seq_id), one draw per decoding step, and picks a token by inverting the
CDF of the filtered distribution. Nothing depends on the batch composition or
on the (dp, tp, pp) layout, so the same seed gives the same tokens in every
layout, up to the floating-point differences of the logits themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from realloc.lengths import ResponseLengths
from realloc.models.vocab_parallel import vocab_parallel_token_logprobs
from realloc.models.weights import param_seed


DECODE_MODES = ("auto", "graph", "static", "eager")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to generate. ``greedy=True`` ignores temperature, top_k and top_p."""

    max_new_tokens: int
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int = 0
    # Ids >= this are never chosen (None: every id of the model): the tokenizer's length, so that the
    # padding rows of a checkpoint's vocabulary cannot produce an id no other model or tokenizer knows.
    vocab_limit: int | None = None
    # How decode steps run (static_decode.py): "auto" captures them in a CUDA graph on a GPU with pp = 1
    # and runs the eager, shrinking-batch loop elsewhere; "graph" insists on the graph; "static" runs the
    # graph's static-shape step op by op (its reference); "eager" is the shrinking-batch loop everywhere.
    decode: str = "auto"
    # Force each row's response length to follow this distribution, drawn from (seed, sequence id)
    # (length_schedule.py): a deterministic long-tailed workload for tests and benchmarks. None: the
    # model's own EOS decides.
    length_schedule: ResponseLengths | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"GenerationConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"GenerationConfig.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"GenerationConfig.temperature must be > 0 (use greedy=True for argmax), "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"GenerationConfig.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"GenerationConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"GenerationConfig.decode must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}")
        if self.length_schedule is not None:
            if not isinstance(self.length_schedule, ResponseLengths):
                raise ValueError(f"GenerationConfig.length_schedule must be a ResponseLengths or None, got "
                                 f"{type(self.length_schedule).__name__}")
            if self.min_new_tokens:
                raise ValueError("GenerationConfig: length_schedule and min_new_tokens both decide where EOS may "
                                 "come; set one of them")
            if self.greedy:
                raise ValueError("GenerationConfig.length_schedule needs sampling (greedy=False)")
            if self.decode in ("graph", "static"):
                raise ValueError("GenerationConfig.length_schedule runs the eager decode loop; use decode='auto' "
                                 "or 'eager'")
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ValueError(f"GenerationConfig.vocab_limit must be >= 1 (None: no limit), got {self.vocab_limit}")

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.eos_token_ids + (self.pad_token_id,):
            if not 0 <= t < vocab_size:
                raise ValueError(f"GenerationConfig: token id {t} (eos/pad) is outside the vocabulary of {vocab_size}")


def sequence_generators(seed: int, seq_ids: Sequence[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(param_seed(seed, f"sample/{int(i)}")) for i in seq_ids]


def filtered_sorted(logits: torch.Tensor, g: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities of the kept tokens in descending order (zeros elsewhere) and their token ids."""
    x = logits.float() / g.temperature
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    v = sorted_x.shape[-1]
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if 0 < g.top_k < v:
        keep[..., g.top_k:] = False
    sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    if g.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= g.top_p, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, order


def draw_uniforms(generators: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """[rows, n] float64: each row's next ``n`` draws, the ones ``sample_tokens`` would take at n steps
    (a generator's vector draw equals its draws one at a time; tests/test_static_decode.py checks it)."""
    return torch.stack([torch.rand(n, generator=gen, dtype=torch.float64) for gen in generators])


def sample_tokens(logits: torch.Tensor, g: GenerationConfig, generators: Sequence[torch.Generator],
                  ban: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] from full-vocabulary logits [B, V], one draw from each row's
    generator (``sample_from_uniforms``)."""
    u = None
    if not g.greedy:
        u = torch.stack([torch.rand((), generator=gen, dtype=torch.float64) for gen in generators])
        u = u.to(logits.device)
    return sample_from_uniforms(logits, g, u, ban)


def sample_from_uniforms(logits: torch.Tensor, g: GenerationConfig, u: torch.Tensor | None,
                         ban: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] from full-vocabulary logits [B, V] and one uniform per row
    (``u`` [B] float64 on the logits' device; None when greedy), all on the device: no host synchronization.

    ``ban`` lists token ids that may not be chosen (EOS before ``min_new_tokens``), as do ids at or past
    ``g.vocab_limit``. The logits are the full vocabulary (gathered over tp), so the limit is by global id
    and the same in every layout. The log-prob is under softmax(logits / temperature) before the ban, the
    limit and top-k/top-p filtering (temperature 1 when greedy), i.e. what an inference forward pass would score.
    """
    raw = logits.float()
    logits = raw.index_fill(-1, ban, float("-inf")) if ban is not None and ban.numel() else raw
    if g.vocab_limit is not None and g.vocab_limit < logits.shape[-1]:
        logits = logits.clone() if logits is raw else logits
        logits[..., g.vocab_limit:] = float("-inf")
    if g.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        assert u is not None, "sampling needs one uniform per row"
        probs, order = filtered_sorted(logits, g)
        cdf = torch.cumsum(probs.double(), dim=-1)
        # Last kept index bounds the pick so rounding in the cdf cannot select a filtered-out token.
        n_kept = (probs > 0).sum(dim=-1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        idx = torch.minimum(idx, n_kept - 1)
        tokens = order.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    # The inference pass's own (chunked) log-prob, over the whole vocabulary these rows hold: no fp32 copy of
    # the [B, V] logits beyond one chunk, and the formula a later forward() scores the token with.
    return tokens, vocab_parallel_token_logprobs(raw, tokens, None, 1.0 if g.greedy else g.temperature)
