"""The chunked vocabulary-parallel log-prob, entropy and normalizer (``realloc.models.vocab_parallel``).

References: the unfused formulas the module had before it was chunked (kept below, on the whole vocabulary
in one process), and torch's own ``log_softmax``. At tp 2 each rank holds half of the vocabulary; values must
equal the reference on every rank and each rank's gradient the reference's gradient of its columns. Memory:
``LiveTensorMeter`` against the bytes of one fp32 chunk, the per-token scalars and the output.
"""

from __future__ import annotations

import pytest
import torch

from mp_pool import GlooPool

B, T, V, PAD = 3, 7, 24, 3  # V includes PAD padding columns (-inf), as the head's padded vocabulary


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as p:
        yield p


# -- the reference: the unfused formulas of the whole vocabulary, one process ---------------------------------


def ref_log_normalizer(x: torch.Tensor) -> torch.Tensor:
    m = x.detach().amax(dim=-1)
    return m + torch.log(torch.exp(x - m.unsqueeze(-1)).sum(dim=-1))


def ref_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float() / temperature
    picked = torch.gather(x, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - ref_log_normalizer(x)


def ref_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float() / temperature
    log_z = ref_log_normalizer(x)
    p = torch.exp(x - log_z.unsqueeze(-1))
    finite_x = torch.where(p > 0, x, torch.zeros_like(x))
    return log_z - (p * finite_x).sum(dim=-1)


def _logits(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
    x[..., V - PAD:] = float("-inf")
    targets = torch.randint(0, V - PAD, (B, T), generator=g)
    return x, targets


def _tp_group(ctx, tp: int):
    sets = [list(range(r, r + tp)) for r in range(0, ctx.world_size, tp)]
    ctx.groups.ensure_rank_sets(sets)
    return ctx.groups.get(sets[ctx.rank // tp])


def _run(ctx, tp: int, what: str, dtype: torch.dtype, temperature: float, chunk: int | None, sliced: bool):
    """Values and this rank's gradient of its vocabulary shard for ``(lp or H) . w``."""
    from realloc.models.vocab_parallel import (vocab_parallel_entropy, vocab_parallel_log_normalizer,
                                               vocab_parallel_token_logprobs)

    group = _tp_group(ctx, tp)
    full, targets = _logits(dtype)
    shard = V // tp
    r = group.rank()
    local = full[..., r * shard:(r + 1) * shard].clone().requires_grad_()
    x, t = (local[:, :-1], targets[:, 1:]) if sliced else (local, targets)  # the head's shifted view
    if what == "logprobs":
        out = vocab_parallel_token_logprobs(x, t, group, temperature, chunk)
    elif what == "entropy":
        out = vocab_parallel_entropy(x, group, temperature, chunk)
    else:
        out = vocab_parallel_log_normalizer(x, group, temperature, chunk)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()
    return out.detach(), local.grad


def _reference(what: str, dtype: torch.dtype, temperature: float, sliced: bool):
    full, targets = _logits(dtype)
    full = full.clone().requires_grad_()
    x, t = (full[:, :-1], targets[:, 1:]) if sliced else (full, targets)
    if what == "logprobs":
        out = ref_token_logprobs(x, t, temperature)
    elif what == "entropy":
        out = ref_entropy(x, temperature)
    else:
        out = ref_log_normalizer(x.float() / temperature)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()
    return out.detach(), full.grad


def test_reference_is_torchs_log_softmax():
    """The kept unfused formulas agree with torch's log_softmax and entropy over the real vocabulary."""
    x, t = _logits(torch.float32)
    real = x[..., :V - PAD] / 0.7
    logp = torch.log_softmax(real, dim=-1)
    assert torch.allclose(ref_token_logprobs(x, t, 0.7), logp.gather(-1, t.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    # log Z - E[x] cancels two numbers near 7: fp32 agrees to ~1e-5 with -sum(p log p)
    assert torch.allclose(ref_entropy(x, 0.7), -(logp.exp() * logp).sum(-1), atol=5e-5)


# chunk sizes: one token (many pieces of a row), 3 (does not divide the row), the row (divides it),
# two rows per chunk (does not divide the 3 rows), everything at once (the default at this vocabulary)
CHUNKS = [1, 3, T, 2 * T, None]


@pytest.mark.parametrize("what", ["logprobs", "entropy", "normalizer"])
@pytest.mark.parametrize("tp", [1, 2])
def test_values_and_gradients_match_the_unfused_formula(pool, what, tp):
    # The entropy is log Z - E[x], a difference of two numbers near 7, and E[x] is summed in another order
    # (sum(exp(x - m) x) / sum(exp(x - m)) instead of sum(p x)): fp32 agrees to ~1e-5 there, as the reference
    # itself does with torch's -sum(p log p) (test_reference_is_torchs_log_softmax).
    atol, grad_atol = (5e-5, 1e-5) if what == "entropy" else (1e-5, 1e-6)
    for temperature in (1.0, 0.7):
        for sliced in (False, True):
            want, want_grad = _reference(what, torch.float32, temperature, sliced)
            for chunk in CHUNKS:
                shard = V // tp
                for r, (got, grad) in enumerate(pool.run(_run, tp, what, torch.float32, temperature, chunk, sliced)):
                    case = (what, tp, temperature, sliced, chunk, r)
                    assert torch.allclose(got, want, atol=atol, rtol=1e-5), case
                    ref = want_grad[..., (r % tp) * shard:(r % tp + 1) * shard]
                    assert torch.allclose(grad, ref, atol=grad_atol, rtol=1e-5), case
                    if tp == 2 and r % tp == 1:
                        assert grad[..., shard - PAD:].eq(0).all(), case  # padding columns get no gradient


@pytest.mark.parametrize("what", ["logprobs", "entropy"])
def test_bf16_logits_get_a_bf16_gradient_of_the_fp32_formula(pool, what):
    want, want_grad = _reference(what, torch.bfloat16, 0.7, True)
    for r, (got, grad) in enumerate(pool.run(_run, 2, what, torch.bfloat16, 0.7, 3, True)):
        assert got.dtype == torch.float32 and grad.dtype == torch.bfloat16
        assert torch.allclose(got, want, atol=5e-5, rtol=1e-5)
        # both gradients are computed in fp32 and rounded once to bf16: at most one bf16 ulp (2^-7) apart
        ref = want_grad[..., r * (V // 2):(r + 1) * (V // 2)].float()
        assert torch.allclose(grad.float(), ref, atol=1e-5, rtol=2 ** -7)


def test_argument_errors():
    from realloc.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_token_logprobs

    x, t = _logits(torch.float32)
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_token_logprobs(x, t[:, 1:], None)
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_entropy(x, None, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_entropy(x, None, temperature=0.0)


# -- memory ------------------------------------------------------------------------------------------------

MEM_ROWS, MEM_LEN, MEM_V, MEM_CHUNK = 4, 64, 2048, 24  # per rank at tp 2: 1024 columns, chunks of 24 tokens


def _peaks(ctx, what: str, chunk: int | None, unfused: bool):
    """Peak new bytes of the forward without grad and of forward + backward, on this rank (tp 2, bf16)."""
    from realloc.models.activations import LiveTensorMeter
    from realloc.models.vocab_parallel import vocab_parallel_entropy, vocab_parallel_token_logprobs

    group = _tp_group(ctx, 2)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(MEM_ROWS, MEM_LEN, MEM_V // 2, generator=g).bfloat16()
    targets = torch.randint(0, MEM_V, (MEM_ROWS, MEM_LEN), generator=g)

    def stat(x):
        if unfused:  # the whole-vocabulary formula of one process: what the module held before chunking
            return ref_token_logprobs(x, targets % x.shape[-1], 1.0) if what == "logprobs" else ref_entropy(x, 1.0)
        if what == "logprobs":
            return vocab_parallel_token_logprobs(x, targets, group, chunk_tokens=chunk)
        return vocab_parallel_entropy(x, group, chunk_tokens=chunk)

    with torch.no_grad(), LiveTensorMeter() as meter:
        stat(logits)
    inference = meter.peak
    leaf = logits.clone().requires_grad_()
    with LiveTensorMeter() as meter:
        stat(leaf).sum().backward()
    return inference, meter.peak


@pytest.mark.parametrize("what, fp32_chunks", [("logprobs", 1), ("entropy", 2)])
def test_live_memory_is_one_fp32_chunk_not_four_copies_of_the_logits(pool, what, fp32_chunks):
    n, v = MEM_ROWS * MEM_LEN, MEM_V // 2
    chunk_bytes = MEM_CHUNK * v * 4
    scalars = 64 * n  # a few fp32 and int64 values per token (max, sums, log Z, targets, picked, output)
    for inference, train in pool.run(_peaks, what, MEM_CHUNK, False):
        # the forward holds the per-token scalars and the chunk (the entropy: its scaled logits and their exp)
        assert fp32_chunks * chunk_bytes <= inference <= fp32_chunks * chunk_bytes + scalars, inference
        # the backward adds its output, d(logits) in bf16
        grad = n * v * 2
        assert grad + fp32_chunks * chunk_bytes <= train <= grad + fp32_chunks * chunk_bytes + scalars, train
    # the unfused formula: three (inference) and four (backward) fp32 tensors the size of the logits
    for inference, train in pool.run(_peaks, what, None, True):
        assert inference >= 3 * n * v * 4 and train >= 4 * n * v * 4
