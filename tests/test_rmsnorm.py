"""The lean RMSNorm (``realloc.models.llama.RMSNorm``) against the plain-torch formula it replaced and HF's
LlamaRMSNorm: the same forward bit for bit, the same gradients, and only x and 1/rms kept for the backward."""

from __future__ import annotations

import pytest
import torch

from realloc.models.activations import LiveTensorMeter, SavedTensorMeter
from realloc.models.llama import RMSNorm

EPS = 1e-5
H = 96  # not a power of two: the mean over the hidden dimension really divides
DTYPES = [torch.float32, torch.bfloat16]


def reference_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula llama.RMSNorm computed before the custom function, with autograd's unfused backward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _inputs(dtype: torch.dtype, shape: tuple[int, ...] = (3, 7, H), seed: int = 0) -> tuple[torch.Tensor, RMSNorm]:
    g = torch.Generator().manual_seed(seed)
    # a residual stream's spread of scales across tokens
    x = (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g).mul(8).add(0.1)).to(dtype)
    norm = RMSNorm(H, EPS, dtype, torch.device("cpu"))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=g) * 0.5 + 1)
    return x, norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_bit_identical_to_the_plain_formula_and_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, norm = _inputs(dtype)
    hf = LlamaRMSNorm(H, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(norm.weight)
    want = reference_rmsnorm(x, norm.weight.detach(), EPS)
    for grad in (False, True):  # inference and the training forward
        with torch.set_grad_enabled(grad):
            got = norm(x.clone().requires_grad_(grad))
        assert got.dtype == dtype and torch.equal(got, want), (dtype, grad)
    with torch.no_grad():
        assert torch.equal(norm(x), hf(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_match_autograd_of_the_plain_formula(dtype):
    x, norm = _inputs(dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    xa = x.clone().requires_grad_(True)
    dx, dw = torch.autograd.grad(norm(xa), (xa, norm.weight), dy)
    w = norm.weight.detach().clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    want_dx, want_dw = torch.autograd.grad(reference_rmsnorm(xb, w, EPS), (xb, w), dy)
    assert dx.dtype == dtype and dw.dtype == dtype
    # fp32: reduction order only; bf16: the reference rounds dy * w and the weight's product to bf16 (one ulp,
    # 2^-8 relative), this function keeps them in fp32. Tolerances relative to each gradient's scale, as
    # dx = r * (g - x_hat * mean(g * x_hat)) cancels on some elements.
    tol = 1e-6 if dtype is torch.float32 else 2e-2
    for got, want in ((dx, want_dx), (dw, want_dw)):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


def test_gradcheck_in_float64():
    x, norm = _inputs(torch.float64, shape=(2, 3, H))
    x.requires_grad_(True)
    w = norm.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: torch.func.functional_call(norm, {"weight": b}, (a,)), (x, w))
    # without grad for the input (a frozen first layer's input) or for the weight (a frozen norm)
    with torch.no_grad():
        norm.weight.requires_grad_(False)
    assert torch.autograd.gradcheck(norm, (x,))
    norm.weight.requires_grad_(True)
    (dw,) = torch.autograd.grad(norm(x.detach()), (norm.weight,), torch.ones_like(x))
    x64 = x.detach()
    assert torch.allclose(dw, (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).sum((0, 1)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saves_only_its_input_and_one_fp32_scalar_per_token(dtype):
    x, norm = _inputs(dtype)
    x.requires_grad_(True)
    tokens = x.numel() // H
    with SavedTensorMeter([norm.weight]) as meter:
        y = norm(x)
    assert meter.peak == x.numel() * x.element_size() + 4 * tokens
    y.backward(torch.ones_like(y))
    assert meter.current == 0
    # the meter sees the plain formula's saves (fp32 input or its copy, 1/rms, the cast product): it would fail
    with SavedTensorMeter([norm.weight]) as meter:
        reference_rmsnorm(x, norm.weight, EPS)
    assert meter.peak == (4 + x.element_size()) * x.numel() + 4 * tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_holds_one_fp32_temporary_beyond_its_gradients(dtype):
    x, norm = _inputs(dtype, shape=(4, 32, H))
    x.requires_grad_(True)
    tokens, e = x.numel() // H, x.element_size()
    dy = torch.randn_like(x)

    def backward_peak(fn) -> int:
        y = fn(x)
        with LiveTensorMeter() as meter:
            torch.autograd.grad(y, (x, norm.weight), dy)
        return meter.peak

    # the fp32 buffer, dx in the input dtype (the buffer itself in fp32), and small change: the per-token
    # mean (fp32) and the weight's gradient (its fp32 sum and the cast)
    grad_in = 0 if dtype is torch.float32 else e * tokens * H
    bound = 4 * tokens * H + grad_in + 4 * tokens + (4 + e) * H
    peak = backward_peak(norm)
    assert 4 * tokens * H + grad_in <= peak <= bound
    # the formula's autograd backward holds several fp32 h-wide tensors: the meter tells them apart
    assert backward_peak(lambda a: reference_rmsnorm(a, norm.weight, EPS)) > bound + 4 * tokens * H
