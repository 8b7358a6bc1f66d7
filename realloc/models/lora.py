"""LoRA adapters on the tensor-parallel linears of a ``LlamaStage`` (the math and the tp split:
``lora_config.py``).

``attach_adapters(stage, cfg, groups)`` gives each target linear two sub-modules, ``lora_A`` and ``lora_B``
(parameter names ``...q_proj.lora_A.weight``, what ``param_layout`` lists), freezes every other parameter
but a critic's ``score``, and adds the adapter path:

- plain tensor parallelism: a forward hook on the megatron layer adds ``s B (A x)`` to its output;
- sequence parallelism (``sequence_parallel.py`` applies the weights itself): ``gather_project`` and
  ``row_parallel`` ask the layer's ``lora_delta_sp`` for the same term on the rank's tokens.

``LoRAState`` is shared by the adapters of one model: ``enabled`` (False: the base model, for the reference
log-probs of a LoRA actor) and the dropout generator. Dropout masks are drawn from a generator seeded the
same on every tp rank of a (dp, pp) coordinate, always for the whole (unsplit) input and then sliced, so every
layout applies the mask the dense model would. Under activation recomputation (reentrant checkpointing runs
the forward without autograd, then again in the backward) the first pass queues the generator's state and
the recomputation replays it, so both passes drop the same inputs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
import realloc.models.megatron_import  # noqa: F401  (first: megatron-core without torch.compile, wandb)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from torch import nn

from realloc.models.config import ModelConfig
from realloc.models.lora_config import COLUMN_MODULES, LoRAConfig, is_adapter
from realloc.models.sequence_parallel import TokenSplit


class _Weight(nn.Module):
    """Holds one adapter matrix under the name ``weight`` (PEFT's ``lora_A.weight``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


@dataclasses.dataclass
class LoRAState:
    """What the adapters of one model share."""

    enabled: bool = True
    generator: torch.Generator | None = None  # dropout; the same seed on every tp rank
    # generator states queued by the no-grad first pass of reentrant recomputation, per adapter
    replay: dict[int, collections.deque] = dataclasses.field(default_factory=dict)

    def clear(self) -> None:
        self.replay.clear()


class Adapter:
    """The adapter path of one megatron linear (not a module: its matrices are the layer's ``lora_A``/``lora_B``
    sub-modules, so the layer's parameter names stay PEFT's)."""

    def __init__(self, layer: nn.Module, column: bool, lora: LoRAConfig, tp_group: dist.ProcessGroup,
                 state: LoRAState) -> None:
        self.layer, self.column, self.state, self.tp_group = layer, column, state, tp_group
        self.scaling, self.p = lora.scaling, lora.dropout

    @property
    def A(self) -> torch.Tensor:
        return self.layer.lora_A.weight

    @property
    def B(self) -> torch.Tensor:
        return self.layer.lora_B.weight

    def active(self) -> bool:
        return self.state.enabled

    # -- dropout ----------------------------------------------------------------------------------

    def _dropout(self, x: torch.Tensor, full_shape: tuple[int, ...], index: tuple[Any, ...],
                 pad_rows: int = 0) -> torch.Tensor:
        """Inverted dropout on ``x``, which is ``full[index]`` of the model's whole input of ``full_shape`` (with
        ``pad_rows`` padding rows appended): every layout draws the same mask for the same tokens."""
        if self.p == 0.0 or not self.layer.training:
            return x
        gen = self.state.generator
        assert gen is not None, "LoRA dropout needs the model's generator (attach_adapters)"
        queue = self.state.replay.setdefault(id(self), collections.deque())
        if not torch.is_grad_enabled():
            queue.append(gen.get_state())  # reentrant recomputation's first pass: remember, replay later
        elif queue:
            replay = torch.Generator(device=gen.device)
            replay.set_state(queue.popleft())
            gen = replay
        keep = torch.rand(full_shape, generator=gen, device=gen.device, dtype=torch.float32) >= self.p
        if pad_rows:  # sequence parallelism's padding tokens (zero rows, dropped by the gather)
            keep = torch.cat([keep, keep.new_ones((pad_rows,) + full_shape[1:])])
        keep = keep.to(x.device)[index]
        return x * keep.to(x.dtype) / (1.0 - self.p)

    # -- the adapter term -------------------------------------------------------------------------

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s B A x`` for the layer's own input and output split (plain tensor parallelism)."""
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        if self.column:
            x = self._dropout(x, tuple(x.shape), (Ellipsis,))
            u = copy_to_tensor_model_parallel_region(F.linear(x, self.A), group=self.tp_group)
            return F.linear(u, self.B) * self.scaling
        n = x.shape[-1]
        x = self._dropout(x, tuple(x.shape[:-1]) + (n * tp,), (Ellipsis, slice(rank * n, (rank + 1) * n)))
        v = reduce_from_tensor_model_parallel_region(F.linear(x, self.A), group=self.tp_group)
        return F.linear(v, self.B) * self.scaling

    def delta_sp(self, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        """The same under sequence parallelism. Column: ``x`` is the rank's ``[local, in]`` tokens, the result
        ``[B, T, out/tp]``. Row: ``x`` is ``[B, T, in/tp]`` for all tokens, the result the rank's ``[local, out]``."""
        rank = self.tp_group.rank()
        if self.column:
            lo = rank * split.local
            x = self._dropout(x, (split.tokens, x.shape[-1]), (slice(lo, lo + split.local),),
                              split.padded - split.tokens)
            u = split.gather(F.linear(x, self.A))
            return F.linear(u, self.B) * self.scaling
        n = x.shape[-1]
        x = self._dropout(x, tuple(x.shape[:-1]) + (n * split.group.size(),),
                          (Ellipsis, slice(rank * n, (rank + 1) * n)))
        return F.linear(split.reduce_scatter(F.linear(x, self.A)), self.B) * self.scaling


def _hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    adapter: Adapter = module.lora
    if not adapter.active():
        return output
    out, bias = output
    return out + adapter.delta(args[0]), bias


def _require_grad(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    # With a frozen embedding, the first block's input would need no gradient; reentrant recomputation then
    # gives its adapters none. Marking it makes autograd run the (cheap) backward into it.
    if torch.is_grad_enabled() and module.training and not output.requires_grad:
        return output.detach().requires_grad_()
    return output


def attach_adapters(stage: nn.Module, cfg: ModelConfig, tp_group: dist.ProcessGroup, dtype: torch.dtype,
                    device: torch.device, dropout_seed: int) -> LoRAState:
    """Give ``stage`` (a ``LlamaStage``) the adapters of ``cfg.lora`` and freeze its base (module docstring).
    The adapters are allocated, not initialized: the owner writes them (``weights.init_shard``)."""
    lora = cfg.lora
    assert lora is not None
    gen = None
    if lora.dropout > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(dropout_seed)
    state = LoRAState(generator=gen)
    for layer in stage.layers:
        for name in lora.target_modules:
            parent = layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp
            linear = getattr(parent, name)
            # the local shards: A keeps the layer's local input width (all of it for a column-parallel layer,
            # the rank's slice for a row-parallel one), B its local output width
            out_local, in_local = linear.weight.shape
            linear.lora_A = _Weight((lora.rank, in_local), dtype, device)
            linear.lora_B = _Weight((out_local, lora.rank), dtype, device)
            linear.lora = Adapter(linear, name in COLUMN_MODULES, lora, tp_group, state)
            linear.register_forward_hook(_hook)
    for name, p in stage.named_parameters():
        p.requires_grad_(is_adapter(name) or name == "score.weight")
    if stage.is_first:
        stage.model.embed_tokens.register_forward_hook(_require_grad)
    return state


@contextlib.contextmanager
def adapters_disabled(state: LoRAState) -> Iterator[None]:
    """The base model for the duration (the reference of a LoRA actor)."""
    prev = state.enabled
    state.enabled = False
    try:
        yield
    finally:
        state.enabled = prev

