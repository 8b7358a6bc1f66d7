"""The value a resumed parameter takes when its checkpoint holds no fp32 master for it: a LoRA model's frozen base.

A model trained in bf16 or fp16 saves fp32 masters of what it trains, and a resume on an fp32 pool starts from
them (``checkpoint.load_model_shard``). Its frozen LoRA base has no masters: it never changes, and the checkpoint
holds it in the pool's dtype, the rounding of its source (the HF weights or the seeded init). Widened on an fp32
pool it kept that bf16 rounding for the rest of the run, where the straight run on the fp32 pool holds the source
itself, so the resumed run was not the straight run on the pools it now runs on.

What a resumed run must equal: the straight run on its own (new) pools. For the frozen base that is the source in
the new pool's dtype, which the worker has just built (the model is made from its source before the checkpoint
loads): it is kept where it rounds to the saved value exactly (the same source). A base that does not (its source
changed since the checkpoint) takes the checkpoint's values, widened, as before: the checkpoint's run goes on. A
saved dtype wider than the pool's, or the pool's own, is copied (rounded as the straight run on that pool rounds its
source); one as wide in another format (bf16 saved, an fp16 pool) is checked as a narrower one.
"""

from __future__ import annotations

import torch


def resumed_value(live: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """What a parameter saved without a master resumes with: ``live`` (this pool's model, just made from its
    source) where ``saved`` is narrower and is exactly ``live``'s rounding, else ``saved``."""
    if not (saved.dtype.is_floating_point and live.dtype.is_floating_point):
        return saved
    if saved.dtype == live.dtype or torch.finfo(saved.dtype).bits > torch.finfo(live.dtype).bits:
        return saved
    if torch.finfo(saved.dtype).bits == torch.finfo(live.dtype).bits:  # bf16 saved, an fp16 pool (a V100's)
        return live if _one_source(live, saved) else saved
    return live if torch.equal(live.to(saved.dtype), saved) else saved


def _one_source(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every element of ``a`` and ``b`` (two 16-bit formats) can be the rounding of one value: they lie
    within half a unit in the last place of each other's formats. ``b.to(a.dtype) == a`` would not do: rounding the
    source to fp16 and then to bf16 differs from rounding it to bf16 once in about 6% of a normal draw's elements."""
    x, y = a.float(), b.float()
    return bool(((x - y).abs() <= (_ulp(x, a.dtype) + _ulp(y, b.dtype)) / 2).all())


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s values at each of ``x``'s elements (its subnormals' below the normal range)."""
    fi = torch.finfo(dtype)
    binade = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 1)
    return torch.where(x == 0, fi.tiny, binade).clamp(min=fi.tiny) * fi.eps
