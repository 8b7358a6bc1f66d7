"""Run megatron-core's tensor-parallel layers on CPU (gloo) without touching the CUDA path.

megatron-core 0.16.1 calls ``torch.cuda`` in a few places that our model reaches
(see ../shared/megatron-on-cpu.md): ``torch.cuda.current_device()`` when a
ColumnParallelLinear gathers its output, ``torch.cuda.synchronize()`` in p2p
helpers, and the CUDA RNG calls of its RNG-state tracker. On a machine without
CUDA we point those at the CPU and seed the tracker once. With CUDA present
nothing is patched, so the same code runs on GPUs unchanged.

Usage: call :func:`prepare_device` with the device a model will live on before
building it. It is idempotent and cheap after the first call.
"""

from __future__ import annotations

import torch

# Marker set on ``torch.cuda`` once patched, so repeated calls (one per model
# instance, possibly several per process) patch and seed exactly once.
_MARKER = "_realloc_cpu_shim_applied"
TRACKER_SEED = 1234


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _noop_synchronize(device: object = None) -> None:
    return None


def _cpu_get_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def cpu_shim_applied() -> bool:
    return bool(getattr(torch.cuda, _MARKER, False))


def apply_cpu_shim(seed: int = TRACKER_SEED) -> bool:
    """Patch megatron's CUDA calls to the CPU. Returns True if it patched now, False if already done.

    Refuses to run when CUDA is available: patching would break the GPU path.
    """
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shim() must not run on a CUDA machine; use prepare_device(torch.device('cuda'))")
    if cpu_shim_applied():
        return False
    import realloc.models.megatron_import  # noqa: F401  (a lean import of megatron-core)
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _noop_synchronize
    # The "CUDA" generator becomes the CPU default generator, as the tracker expects one.
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    setattr(torch.cuda, _MARKER, True)

    # Attention-style code forks megatron's tracker even with dropout 0, so it
    # must hold states. Our layers do not draw random numbers, hence ranks 0:
    # the tracker is process-wide and cannot follow per-model TP ranks anyway.
    # Seeding must not disturb the caller's CPU RNG stream.
    saved = torch.get_rng_state()
    try:
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    finally:
        torch.set_rng_state(saved)
    return True


def prepare_device(device: torch.device | str) -> torch.device:
    """Make megatron-core usable on ``device`` and return it as a ``torch.device``.

    CPU without CUDA: apply the shim. CUDA: select the device; nothing is patched.
    """
    device = torch.device(device)
    if device.type == "cpu":
        if not torch.cuda.is_available():
            apply_cpu_shim()
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available; use device='cpu'")
        if device.index is not None:
            torch.cuda.set_device(device)
        return device
    raise ValueError(f"unsupported device {device}; use 'cpu' or 'cuda[:i]'")
