"""Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.3).

fp16 has 5 exponent bits: a gradient below 2^-24 flushes to zero and one above 65504 overflows, and an LLM's
gradients span both. The train step multiplies the loss by a scale S before the backward pass, so that small
gradients stay representable in the fp16 backward, and divides the fp32 main gradients by S before clipping
and the step (``engine.train_step``). A step whose gradients overflowed (their norm is not finite) is skipped
and S halves; after ``growth_interval`` steps in a row without overflow S doubles, so S stays near the largest
value that does not overflow. bf16 has fp32's exponent range and needs none of this: only fp16 models (V100
pools, or ``dtype="fp16"``) get a scale (``ParallelModel.make_optimizer``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class DynamicLossScale:
    """The optimizer-side state of dynamic loss scaling; every rank of a model updates it alike (the gradient
    norm it reads is reduced over the model's groups)."""

    scale: float = 2.0**16
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0  # steps without overflow since the scale last changed

    def update(self, finite: bool) -> None:
        """After a step: grow after ``growth_interval`` finite steps, halve after an overflow."""
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * 2.0, 0
        else:
            self.scale, self.good_steps = max(self.scale / 2.0, self.min_scale), 0
