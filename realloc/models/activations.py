"""Measured activation memory: the bytes autograd keeps alive for the backward pass.

``SavedTensorMeter`` counts every tensor saved for backward while it is active
(``torch.autograd.graph.saved_tensors_hooks``), once per storage, from the moment
it is saved until autograd frees it, and records the peak. Parameters (and any
other tensors passed as ``exclude``) are not activations and are skipped. This is
the quantity ``realloc.estimator.memory`` calls saved activations: per-layer saves
without recomputation, layer inputs (plus one layer being recomputed) with it.
It works on every device, including CPU where no allocator statistics exist::

    with SavedTensorMeter(model.params().values()) as meter:
        model.train_step(micro_batches, loss_fn, optimizer, recompute=True)
    print(meter.peak)

``LiveTensorMeter`` counts more: every tensor an operator creates while it is active,
saved for backward or not (temporaries, gradients, outputs), from its creation until
its storage is freed, and records the peak. That is what a caching allocator's peak
would show, minus the memory held before the meter started; the memory model's
peaks of the log-prob head (``estimator/opcount.py``) are checked against it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Saved:
    """What autograd holds instead of a saved tensor; releases its storage's count when autograd drops it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "SavedTensorMeter", key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage address -> [saved references, bytes]
        self.current = 0
        self.peak = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return t
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed  # type: ignore[return-value]

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]


class LiveTensorMeter(TorchDispatchMode):
    """Peak bytes of the tensors created by operators while active (module docstring).

    An operator output whose storage is not one of the operator's inputs' (a view or an in-place
    result) is a new allocation: counted once, until its storage is freed. Frees are noticed at the
    next operator, which is when a new allocation could raise the peak, so the peak is exact up to
    memory an operator allocates and frees inside itself (workspaces)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address -> (weak ref, bytes)
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._live or storage.nbytes() == 0:
                continue
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out
