"""Distributed optimizer: AdamW whose state is sharded over the data-parallel ranks (ZeRO stage 1).

Every dp replica of a (tp, pp) shard holds the same parameters and, after the gradient average,
the same gradients, so replicating the optimizer state over dp wastes 12 bytes per parameter (bf16:
fp32 master, Adam m and v) or 8 (fp32: m and v) on every replica. Adam is elementwise, so the
update of any slice of a tensor depends only on that slice: each dp rank keeps the state of one
slice of every local tensor and steps only it, and the results are those of the unsharded optimizer
(Rajbhandari et al., ZeRO, stage 1; Megatron's distributed optimizer). Static memory per parameter
becomes param + main_grad + optimizer/dp (``estimator/memory.py``, rule 2).

A train step with it (``engine.ParallelModel.train_step``), per bucket of tensors (``plan_buckets``):

1. reduce-scatter: every rank lays its gradients out rank-major in one flat buffer (in the
   gradients' dtype: fp32, or bf16 with ``grad_dtype=torch.bfloat16``, half the bytes), each
   tensor split into dp equal chunks (the last one padded), and a reduce-scatter leaves on rank r
   the dp-sum of chunk r of every tensor, which is divided by dp and written back into the
   gradient's own chunk (the rest of the gradient is then stale and never read);
2. the global norm from the chunks (their squares summed over dp as well as tp and pp) and
   clipping of the chunks, as ``grads.global_norm``/``grads.clip_`` do for whole tensors;
3. AdamW on the chunks (torch's, one tensor at a time, as ``optim.MasterWeightAdamW``; bf16 gradient
   chunks are converted to fp32 one at a time, ``optim.step_each``); bf16 models step fp32 master
   chunks and write them, rounded, into their chunk of the parameter; fp32 models step their
   parameter's chunk in place (a view, no copy);
4. all-gather: the updated chunks, laid out as in 1, give every rank the whole updated parameters.

The reduce-scatter and all-gather run in place inside their flat buffer (the rank's own segment is
the output or the input), which NCCL and gloo (torch >= 2.13) both support natively; together they
move the bytes of the one all-reduce they replace plus the parameters once.

The chunking depends on dp, so checkpoints hold the whole state of each (tp, pp) shard, gathered to
the writing rank one tensor at a time (``gathered_state``), and every rank keeps its own chunk when
it loads (``load_full_state``): a checkpoint written at one dp resumes at another.
"""

from __future__ import annotations

import zlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from realloc.models.collective_wait import blocking
from realloc.models.loss_scale import DynamicLossScale
from realloc.models.optim import GRAD_DTYPES, step_each
# torch-free, so that the estimator plans with it before any torch import
from realloc.models.zero_chunks import BUCKET_NUMEL, chunk_numel, chunk_range, plan_buckets  # noqa: F401


class DistributedAdamW:
    """AdamW over the local shards of a model with dp > 1, its state sharded over ``dp_group``.

    ``masters=True`` (low-precision parameters) keeps fp32 master chunks; otherwise the chunks stepped are
    views of the fp32 parameters themselves. ``grad_dtype`` is the dtype of the gradients the model
    accumulates for it (bf16 only with masters). Parameters are visited in name order, so every dp rank
    builds the same buckets.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], dp_group: dist.ProcessGroup, lr: float,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, *,
                 masters: bool, grad_dtype: torch.dtype = torch.float32) -> None:
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"DistributedAdamW: grad_dtype must be torch.float32 or torch.bfloat16, got {grad_dtype}")
        if grad_dtype != torch.float32 and not masters:
            raise ValueError("DistributedAdamW: bf16 gradients need fp32 master chunks (masters=True)")
        self.grad_dtype = grad_dtype
        self.loss_scale: DynamicLossScale | None = None  # fp16 models: set by make_optimizer (loss_scale.py)
        self.params = {n: params[n] for n in sorted(params)}
        self.group = dp_group
        self.dp = dp_group.size()
        self.dp_rank = dist.get_rank(dp_group)
        self.keeps_masters = masters
        self.ranges = {n: chunk_range(p.numel(), self.dp, self.dp_rank) for n, p in self.params.items()}
        # The tensors AdamW steps, keyed by the parameter's name: fp32 master chunks, or (fp32 models)
        # Parameters re-pointed at their parameter's chunk before every use (``_chunk_views``), so that
        # release()/materialize() of the model's storage never leaves them stale.
        self.chunks: dict[str, torch.nn.Parameter] = {}
        for n, p in self.params.items():
            own = self._param_chunk(n)
            self.chunks[n] = torch.nn.Parameter(own.float().clone() if masters else own)
        decay = [self.chunks[n] for n, p in self.params.items() if p.dim() >= 2]
        no_decay = [self.chunks[n] for n, p in self.params.items() if p.dim() < 2]
        self.inner = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                                       foreach=False)  # one tensor at a time: bounded temporaries
        sizes = [p.numel() for p in self.params.values()]
        names = list(self.params)
        self.buckets = [[names[i] for i in b] for b in plan_buckets(sizes, self.dp)]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups, e.g. to change the learning rate."""
        return self.inner.param_groups

    def _param_chunk(self, name: str) -> torch.Tensor:
        lo, hi = self.ranges[name]
        return self.params[name].detach().view(-1)[lo:hi]

    def _chunk_views(self) -> None:
        if not self.keeps_masters:
            for n, c in self.chunks.items():
                c.data = self._param_chunk(n)

    # -- the train step ---------------------------------------------------------------------------

    def _flat(self, bucket: list[str], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
        seg = sum(chunk_numel(self.params[n].numel(), self.dp) for n in bucket)
        return torch.empty(self.dp * seg, dtype=dtype, device=device), seg

    @torch.no_grad()
    def reduce_scatter_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Average the gradients over dp; returns this rank's reduced chunks (views into ``grads``)."""
        for bucket in self.buckets:
            g0 = grads[bucket[0]]
            flat, seg = self._flat(bucket, g0.dtype, g0.device)
            off = 0
            for n in bucket:
                g, c = grads[n].view(-1), chunk_numel(grads[n].numel(), self.dp)
                for r in range(self.dp):
                    lo, hi = chunk_range(g.numel(), self.dp, r)
                    flat[r * seg + off:r * seg + off + hi - lo].copy_(g[lo:hi])
                off += c
            mine = flat[self.dp_rank * seg:(self.dp_rank + 1) * seg]
            blocking(dist.reduce_scatter_single, mine, flat, group=self.group)  # in place: the output is our own segment
            mine.div_(self.dp)
            off = 0
            for n in bucket:
                lo, hi = self.ranges[n]
                grads[n].view(-1)[lo:hi].copy_(mine[off:off + hi - lo])
                off += chunk_numel(grads[n].numel(), self.dp)
        return {n: grads[n].view(-1)[slice(*self.ranges[n])] for n in self.params}

    @torch.no_grad()
    def step_with(self, chunk_grads: Mapping[str, torch.Tensor]) -> None:
        """One AdamW step of this rank's chunks from their reduced (and clipped) gradients (fp32, or bf16
        converted one chunk at a time), then the all-gather of the updated parameters."""
        self._chunk_views()
        if all(g.dtype == torch.float32 for g in chunk_grads.values()):
            for n, c in self.chunks.items():
                c.grad = chunk_grads[n]
            self.inner.step()
        else:
            step_each(self.inner, ((c, chunk_grads[n]) for n, c in self.chunks.items()))
        for n, c in self.chunks.items():
            c.grad = None
            if self.keeps_masters:
                self._param_chunk(n).copy_(c)
        self._all_gather_params()

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        for bucket in self.buckets:
            p0 = self.params[bucket[0]]
            flat, seg = self._flat(bucket, p0.dtype, p0.device)
            mine = flat[self.dp_rank * seg:(self.dp_rank + 1) * seg]
            off = 0
            for n in bucket:
                lo, hi = self.ranges[n]
                mine[off:off + hi - lo].copy_(self._param_chunk(n))
                off += chunk_numel(self.params[n].numel(), self.dp)
            blocking(dist.all_gather_single, flat, mine, group=self.group)  # in place: the input is our own segment
            off = 0
            for n in bucket:
                p = self.params[n].detach().view(-1)
                for r in range(self.dp):
                    lo, hi = chunk_range(p.numel(), self.dp, r)
                    p[lo:hi].copy_(flat[r * seg + off:r * seg + off + hi - lo])
                off += chunk_numel(p.numel(), self.dp)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Take the parameters' current values as masters (after loading weights into the model)."""
        if self.keeps_masters:
            for n, c in self.chunks.items():
                c.copy_(self._param_chunk(n))

    # -- checkpoints: the whole state of the (tp, pp) shard, independent of dp --------------------

    def _gather(self, name: str, chunk: torch.Tensor) -> torch.Tensor:
        """The whole tensor ``name`` (parameter-shaped) from every rank's chunk of it; collective over dp."""
        p = self.params[name]
        c = chunk_numel(p.numel(), self.dp)
        flat = torch.empty(self.dp * c, dtype=chunk.dtype, device=chunk.device)
        mine = flat[self.dp_rank * c:(self.dp_rank + 1) * c]
        mine[:chunk.numel()].copy_(chunk.reshape(-1))
        dist.all_gather_single(flat, mine, group=self.group)
        return flat[:p.numel()].view(p.shape)

    def _state_names(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's AdamW state entries by name, in name order, checked to be the same on every dp rank.

        The gathers below pair up the ranks' tensors by the order of their calls, so every rank must gather the
        same entry of the same parameter at the same time. A state dict's own order is no guide: a loaded
        one's follows the order its keys were read in, which may differ between processes."""
        names = {n: tuple(sorted(self.inner.state.get(c, {}))) for n, c in self.chunks.items()}
        # One collective for all parameters: every rank's entries hashed the same way (a CRC, not Python's
        # per-process string hash), compared by their min and max over dp.
        device = next(iter(self.chunks.values())).device if self.chunks else torch.device("cpu")  # NCCL: the GPU
        code = torch.tensor([zlib.crc32(repr(sorted(names.items())).encode())], dtype=torch.int64, device=device)
        lo, hi = code.clone(), code.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        assert int(lo) == int(hi), f"DistributedAdamW: dp ranks hold different optimizer state entries: {names}"
        return names

    @torch.no_grad()
    def gathered_state(self) -> Iterator[tuple[str, torch.Tensor | None, dict[str, torch.Tensor]]]:
        """(name, fp32 master or None, AdamW state: step and whole moments) of every parameter, one at a time
        and on the host, so device memory holds one gathered tensor at most. Collective over dp: every dp rank
        iterates it to the end, gathering parameters and state entries by name, in name order."""
        self._chunk_views()
        entries = self._state_names()
        for n, c in self.chunks.items():
            master = self._gather(n, c).cpu() if self.keeps_masters else None
            own = self.inner.state.get(c, {})
            state = {}
            for k in entries[n]:
                v = own[k]
                # the moments are chunk-shaped; the step count is a scalar, the same on every rank
                state[k] = self._gather(n, v).cpu() if v.dim() > 0 else v.detach().cpu().clone()
            yield n, master, state

    @torch.no_grad()
    def load_full_state(self, name: str, master: torch.Tensor | None, state: Mapping[str, torch.Tensor]) -> None:
        """Keep this rank's chunk of a parameter's whole saved state (``gathered_state``'s form)."""
        self._chunk_views()
        c = self.chunks[name]
        lo, hi = self.ranges[name]
        if self.keeps_masters:
            if master is None:
                raise ValueError(f"DistributedAdamW: no fp32 master weight for {name!r}")
            c.copy_(master.reshape(-1)[lo:hi])
        if state:
            self.inner.state[c] = {k: state[k].to(c.device).reshape(-1)[lo:hi].clone() if state[k].dim() > 0
                                   else state[k].clone() for k in sorted(state)}  # name order on every rank
