"""Analytic layer costs for devices without a measured profile (realhf.txt section 5.1, "time cost").

Each op is split into GEMM, attention and elementwise work (``opcount.py``). A
part takes the larger of its compute time and its memory time (a roofline);
elementwise work is memory-bound. So training, inference and prefill come out
compute-bound and decode comes out bandwidth-bound on weights and KV cache,
without the caller telling which is which.

Device time of an op = GEMM + attention + elementwise + kernels x kernel_latency.
With eager launches the host must also issue every kernel; launches overlap the
device, so an op takes max(device time, kernels x launch_overhead). That is why
decode steps, whose kernels are tiny, get faster under CUDA graphs
(realhf-appendix.txt Table 6: 44.2 s vs 104.6 s).

The efficiencies are physical and live in the hardware JSON: the fraction of
peak FLOP/s that large GEMMs reach (``compute_efficiency``) and the fraction of
peak HBM bandwidth that streaming reads reach (``memory_efficiency``).
"""

from __future__ import annotations

from realloc.estimator.comm import CommModel, Link
from realloc.estimator.hardware import HardwareSpec
from realloc.estimator.opcount import OpWork, Part, Phase, op_work
from realloc.models.config import ModelConfig


def work_time(work: OpWork, hw: HardwareSpec, eager: bool) -> float:
    """Seconds of one op's local work (collectives excluded) on device ``hw``."""
    flops = hw.peak_flops * hw.compute_efficiency
    bw = hw.memory_bandwidth * hw.memory_efficiency
    device = (max(work.gemm_flops / flops, work.gemm_bytes / bw)
              + max(work.attn_flops / flops, work.attn_bytes / bw)
              + work.elem_bytes / bw
              + work.kernels * hw.kernel_latency)
    if eager:
        return max(device, work.kernels * hw.launch_overhead)
    return device


def collectives_time(work: OpWork, comm: CommModel, tp: int) -> float:
    """The op's tensor-parallel collectives; a tp group never leaves its node (strategy_error)."""
    return sum(c.count * comm.time(c.op, tp, c.nbytes, Link.INTRA) for c in work.tp_collectives)


class RooflineCosts:
    """Layer op costs of one model on one device kind, from its hardware spec alone."""

    source = "roofline"

    def __init__(self, cfg: ModelConfig, hw: HardwareSpec, comm: CommModel, eager_decode: bool = False) -> None:
        self.cfg, self.hw, self.comm = cfg, hw, comm
        self.precision = hw.precision
        # Only decode is launch-bound; the other phases launch few, large kernels.
        self.eager_decode = eager_decode

    def work(self, part: Part, phase: Phase, tp: int, b: int, s: int) -> OpWork:
        return op_work(self.cfg, part, phase, tp, b, s, self.precision)

    def op(self, part: Part, phase: Phase, tp: int, b: int, s: int) -> tuple[float, float]:
        """(local compute, tp collectives) seconds of one op on one device."""
        w = self.work(part, phase, tp, b, s)
        eager = self.eager_decode and phase is Phase.DECODE
        return work_time(w, self.hw, eager), collectives_time(w, self.comm, tp)

    def engine(self, key: str, tp: int, b: int, s: int) -> float | None:
        """No measured engine overheads: the hardware spec's host terms apply instead."""
        return None

    def interface(self, key: str, tp: int, gen_len: int) -> float | None:
        """No measured interface overheads."""
        return None

    def optimizer(self, n_params: int) -> float:
        """One Adam step over ``n_params`` local parameters: bandwidth-bound, a handful of fused kernels."""
        bw = self.hw.memory_bandwidth * self.hw.memory_efficiency
        return n_params * self.precision.optimizer_step_bytes / bw + 4 * self.hw.kernel_latency
