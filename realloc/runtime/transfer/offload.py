"""Drop, offload to host memory and reload the parameters of a model on one device.

Frozen models (reference, reward) sit idle between their calls; realhf.txt §6 moves them
to host memory meanwhile. The tensor *objects* stay the same (modules keep pointing at the
same ``nn.Parameter``); only their data is swapped: while offloaded or dropped each tensor
is an empty tensor of its dtype, so a forward pass on it fails with a shape error rather
than reading stale or freed memory, and its device memory is released as soon as nothing
else references it (pass the tensors the model uses, e.g. ``model.named_parameters()``).

- GPU: the bytes are copied into pinned host buffers on a side CUDA stream (the copy
  overlaps with work on the main stream, as in the paper), then the device memory is
  released. ``reload`` copies back on the side stream and returns once the weights are on
  the device.
- CPU: "device" memory is host memory, so the host copy is a separate CPU buffer and the
  tensors are emptied the same way. Memory use is unchanged overall, but the code path is
  the one GPUs take.

Tensors that share one storage (tied weights, views) are saved once and come back still
sharing it. Optimizer state is never touched here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Mapping

import torch


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def free_tensors(tensors: Iterable[torch.Tensor]) -> int:
    """Drop the data of ``tensors`` (each becomes empty, same dtype/device). Returns their bytes."""
    freed = 0
    for t in _unique(tensors):
        freed += t.numel() * t.element_size()
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return freed


@dataclasses.dataclass
class _Saved:
    tensor: torch.Tensor
    storage_key: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _side_stream(tensors: Iterable[torch.Tensor]) -> "torch.cuda.Stream | None":
    return torch.cuda.Stream() if any(t.is_cuda for t in tensors) else None


class HostOffload:
    """Offload/reload the data behind a set of parameters, in place. One instance per model.

    ``offload()`` then ``reload()`` restores every tensor bit for bit, with its shape, strides
    and storage sharing.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._tensors = _unique(params.values())
        self._saved: list[_Saved] = []
        self._host: dict[int, tuple[torch.Tensor, torch.device]] = {}  # storage key -> (uint8 bytes, device)

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self) -> int:
        """Copy the parameters' storage to host memory and release it on the device. Returns bytes copied."""
        if self._saved:
            raise RuntimeError("offload(): the parameters are already offloaded; reload() them first")
        stream = _side_stream(self._tensors)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # pending writes to the weights come first
        saved, host = [], {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for t in self._tensors:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in host:
                    src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
                    buf = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=t.is_cuda)
                    buf.copy_(src, non_blocking=t.is_cuda)
                    host[key] = (buf, t.device)
                saved.append(_Saved(t, key, t.storage_offset(), tuple(t.shape), tuple(t.stride())))
        if stream is not None:
            stream.synchronize()  # the copies must land before the device memory is released
        for s in saved:
            s.tensor.data = torch.empty(0, dtype=s.tensor.dtype, device=s.tensor.device)
        self._saved, self._host = saved, host
        return sum(b.numel() for b, _ in host.values())

    def reload(self) -> int:
        """Bring the parameters back to their device. Returns bytes copied."""
        if not self._saved:
            raise RuntimeError("reload(): the parameters are not offloaded")
        stream = _side_stream(s.tensor for s in self._saved)
        restored: dict[int, torch.UntypedStorage] = {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for key, (buf, device) in self._host.items():
                dev_bytes = torch.empty(buf.numel(), dtype=torch.uint8, device=device)
                dev_bytes.copy_(buf, non_blocking=device.type == "cuda")
                restored[key] = dev_bytes.untyped_storage()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
            stream.synchronize()
        for s in self._saved:
            s.tensor.data = torch.empty(0, dtype=s.tensor.dtype, device=s.tensor.device).set_(
                restored[s.storage_key], s.offset, s.size, s.stride)
        n = sum(b.numel() for b, _ in self._host.values())
        self._saved, self._host = [], {}
        return n
