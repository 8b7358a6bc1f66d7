"""Each rollout's KV cache kept across its turns (realloc/models/turn_cache.py) against the conversation prefilled
again at every turn (``interface_args["kv_cache"] = False``), on real gloo ranks with a tiny random model: the same
sampled tokens, masks and rewards, log-probs equal to 1e-6 (the kept keys were computed one decode step at a
time, the re-prefilled ones in one pass), and only the appended tokens prefilled."""

from __future__ import annotations

import pytest
import torch

# the fixtures too: a 2-rank gloo pool and the tiny character tokenizer
from test_multiturn import ENV, PROMPTS, _gathered, _generate, _runs, pool, tokenizer_dir  # noqa: F401


def _appended(tokens: list[int], policy: list[bool], plen: int) -> int:
    """Prompt tokens a rollout's turns prefill when each keeps its cache: the prompt and first observation, then
    per later turn the previous turn's last sampled token (never fed in) and the observation after it."""
    runs = _runs(tokens, policy)
    total = plen + (len(runs[0][1]) if not runs[0][0] else 0)
    for i, (is_policy, toks) in enumerate(runs):
        if not is_policy and i > 0 and i + 1 < len(runs):  # an observation between two policy turns
            total += 1 + len(toks)
    return total


@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 1, 2), (1, 2, 1)], ids=["one", "pp2", "tp2"])
def test_kept_caches_sample_what_prefilling_again_samples(pool, tokenizer_dir, layout):
    again = _gathered(pool.run(_generate, tokenizer_dir, *layout, env={**ENV, "kv_cache": False}))
    kept = _gathered(pool.run(_generate, tokenizer_dir, *layout, env=ENV))  # kv_cache: on by default
    for k in ("tokens", "gen_mask", "loss_mask", "score"):
        assert torch.equal(kept[k], again[k]), k
    assert kept["loss_mask"].sum() > 0 and (kept["gen_mask"] & ~kept["loss_mask"]).sum() > 0
    torch.testing.assert_close(kept["logp"], again["logp"], rtol=0, atol=1e-6)
    sums = kept["sums"][0]
    want = sum(_appended(kept["tokens"][b, len(p):len(p) + int(kept["gen_mask"][b].sum())].tolist(),
                         kept["loss_mask"][b, :int(kept["gen_mask"][b].sum())].tolist(), len(p))
               for b, p in enumerate(PROMPTS))
    assert sums["prefill_tokens"] == want and sums["cached_tokens"] > 0
    assert "prefill_tokens" not in again["sums"][0]
