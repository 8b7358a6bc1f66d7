"""A seeded EOS schedule: response lengths that follow a chosen distribution (issue 31, item 6).

For tests and benchmarks of long-tailed generation on models whose own lengths would not be long-tailed
(a random-init model on the CPU cluster never stops, or stops at chance). With
``GenerationConfig.length_schedule`` set, every row draws its length n from the distribution
(``realloc.lengths.ResponseLengths``, over 1 .. max_new_tokens) by inverting its CDF at a uniform number
derived from (seed, sequence id) alone; its first n - 1 tokens are sampled with EOS banned and its n-th is
the first EOS id (without EOS ids, as for a random-init model on token ids, the row is cut after its n-th
sampled token, as ``max_new_tokens`` cuts it). Nothing else changes: the other tokens are drawn as without the schedule (one uniform
per row per step from the row's own generator), and each token's log-prob is the model's, under
softmax(logits / temperature), as an inference pass scores it. So lengths depend only on the seed and the
sequence ids, never on the layout, the batch or the model.
"""

from __future__ import annotations

from typing import Sequence

import torch

from realloc.lengths import ResponseLengths
from realloc.models.vocab_parallel import vocab_parallel_token_logprobs
from realloc.models.weights import param_seed


def scheduled_lengths(schedule: ResponseLengths, max_new_tokens: int, seed: int, seq_ids: Sequence[int]) -> list[int]:
    """Each row's response length: the schedule's quantile at a uniform number of (seed, sequence id)."""
    out = []
    for i in seq_ids:
        u = (param_seed(seed, f"length/{int(i)}") >> 10) / float(1 << 53)  # 53 random bits in [0, 1)
        out.append(schedule.quantile(u, max_new_tokens))
    return out


def force_lengths(logits: torch.Tensor, tokens: torch.Tensor, stop: torch.Tensor, eos: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] (drawn with EOS banned) with the first EOS id where ``stop`` [B] bool says the row ends now,
    and every token's log-prob under softmax(logits / temperature) (``sampling.sample_from_uniforms``'s)."""
    tokens = torch.where(stop.to(tokens.device), eos[0].to(tokens.device), tokens)
    return tokens, vocab_parallel_token_logprobs(logits.float(), tokens, None, temperature)
