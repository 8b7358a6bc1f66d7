"""What the worker processes of bench_model.py and bench_packing.py share: one process group per device,
the layouts of a model that fit the world, and the train step's loss (mean NLL of the real tokens)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


def start(rank: int, world: int, store: str, device: str) -> torch.device:
    """This process's device, one thread, and the world's process group (gloo on CPU, NCCL on GPUs)."""
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def model_layouts(cfg: Any, layouts: Sequence[tuple[int, int, int]], world: int) -> tuple[Any, list]:
    """(a ProcessGroupCache holding their groups, the ``(dp, tp, pp)`` layouts on ranks 0.. that fit ``world``
    and that the model allows)."""
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.strategy import ParallelStrategy, strategy_error

    cache = ProcessGroupCache()
    out = [ModelLayout.for_model(cfg, tuple(range(dp * tp * pp)), ParallelStrategy(dp, tp, pp))
           for dp, tp, pp in layouts if dp * tp * pp <= world
           and strategy_error(cfg, ParallelStrategy(dp, tp, pp), world) is None]
    cache.ensure_layouts(out)
    return cache, out


def nll_loss(out: Any, mb: Any) -> tuple[torch.Tensor, dict]:
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / mask.sum(), {}
