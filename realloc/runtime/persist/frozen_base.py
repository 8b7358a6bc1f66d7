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
saved dtype at least as wide as the pool's is copied (rounded as the straight run on that pool rounds its source).
"""

from __future__ import annotations

import torch


def resumed_value(live: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """What a parameter saved without a master resumes with: ``live`` (this pool's model, just made from its
    source) where ``saved`` is narrower and is exactly ``live``'s rounding, else ``saved``."""
    if not (saved.dtype.is_floating_point and live.dtype.is_floating_point):
        return saved
    if torch.finfo(saved.dtype).bits >= torch.finfo(live.dtype).bits:
        return saved
    return live if torch.equal(live.to(saved.dtype), saved) else saved
