"""The train-step API: a train step is a loss function plus the stats it declares; realloc does the rest.

    def my_loss(mb: MiniBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(mb.logprobs() - mb["logp"]["logp"])
        return -mb.extra["adv"] * ratio, {"ratio": ratio}          # per-token loss [n, T], declared stats

    Interface("my_actor", TRAIN_STEP, TrainStep(my_loss, stats=("ratio",), prepare=my_advantages),
              inputs=("seq", "logp", "rewards"), config="mine", config_type=MyConfig)

What :class:`TrainStep` does for every call, so that the loss function does not:

- **mini-batches**: the call's batch is split into the settings' ``n_minibatches`` optimizer steps. Mini-batch k
  holds the sequences whose global index is k mod M, in every layout, so every plan takes the same steps;
- **normalization and dp/pp**: a per-token loss ``[n, T]`` is weighted by ``loss_norm`` (``token``: mean over the
  mini-batch's response tokens; ``sequence``: mean over each response, then over the responses; ``constant``: sum
  over a response / ``gen_len``, mean over responses), a per-sequence loss ``[n]`` is averaged over the mini-batch's
  sequences. The counts are of the whole mini-batch, all dp ranks and micro-batches together, so the gradient
  does not depend on dp, the micro-batch split or the pipeline; the loss runs on the last pipeline stage only;
- **the optimizer**: micro-batches (``n_mbs`` of the plan), gradient clipping at ``max_grad_norm``, and the
  settings' learning-rate schedule (``lr_schedule``, ``warmup_proportion``, ``min_lr_ratio``; ``lr_at``);
- **stats**: each declared stat is a per-token ``[n, T]`` tensor (reported as its mean over response tokens) or a
  per-sequence ``[n]`` one (mean over sequences), averaged over the mini-batches. metrics.jsonl gets them as
  ``<model>_<stat>`` with ``<model>_loss``, ``<model>_grad_norm`` and ``<model>_lr`` (``actor_loss``, ...).

``prepare(rollout) -> {name: [n, ...]}`` runs once per call on this dp rank's whole batch, before the
mini-batches: per-sequence tensors such as advantages, read in the loss as ``mb.extra[name]``. Batch-wide
normalizers reduce over the dp ranks through ``Rollout.whiten`` / ``Rollout.batch_sum``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping

import torch

from realloc.algorithms import losses
from realloc.algorithms.common import forward_batch, optimizer_step, response_columns
from realloc.algorithms.context import CallContext, CallResult, Data, dp_all_reduce
from realloc.models.batch import split_batch

__all__ = ["MiniBatch", "Rollout", "TrainStep"]

LossNorm = Literal["token", "sequence", "constant"]
_ROWS = "_rows"  # the micro-batch's rows of this dp rank's batch, travelling through the engine with the tokens


@dataclasses.dataclass
class _Rows:
    """Rows of a train step's inputs: ``rows["role"]["tensor"]``, the settings, the response mask."""

    ctx: CallContext
    inputs: Data  # {slot role: {tensor name: [n, ...]}}

    def __getitem__(self, role: str) -> dict[str, torch.Tensor]:
        return self.inputs[role]

    @property
    def config(self) -> Any:
        return self.ctx.config

    @property
    def mask(self) -> torch.Tensor:
        """[n, T] bool: the response tokens (``seq.gen_mask``)."""
        return self.inputs["seq"]["gen_mask"]


@dataclasses.dataclass
class Rollout(_Rows):
    """This dp rank's whole batch, as ``prepare`` sees it."""

    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel ranks (every rank of the call gets the whole batch's sum)."""
        return dp_all_reduce(self.ctx.model, t.detach().double().cpu().clone())

    def whiten(self, x: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
        """``(x - mean) / (std + eps)`` with the mean and the (population) std of ``x`` over the whole batch,
        all dp ranks together: over the response tokens (``mask``, default the response mask) of an [n, T]
        ``x``, over the sequences of an [n] one. 0 outside the mask."""
        if x.dim() == 1:
            mask = torch.ones_like(x, dtype=torch.bool)
        mask = self.mask if mask is None else mask
        m = mask.to(torch.float64)
        xd = x.double() * m
        s = self.batch_sum(torch.stack([m.sum(), xd.sum(), (xd * xd).sum()]))
        n = max(float(s[0]), 1.0)
        mean = float(s[1]) / n
        var = max(float(s[2]) / n - mean * mean, 0.0)
        return ((x.double() - mean) / (var ** 0.5 + eps) * m).to(x.dtype)


@dataclasses.dataclass
class MiniBatch(_Rows):
    """One micro-batch of one optimizer step, as the loss function sees it: this rank's rows of it (``inputs`` on
    the model's device)."""

    head: Any = None  # the model's output on these rows (engine.HeadOutput)
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # what ``prepare`` returned, these rows

    def _columns(self, per_position: torch.Tensor, shift: int = 0) -> torch.Tensor:
        seq = self.inputs["seq"]
        return response_columns(per_position, seq["prompt_lens"], seq["gen_mask"], shift=shift)

    def logprobs(self, temperature: float | None = None) -> torch.Tensor:
        """[n, T]: log-probs of the response tokens under the model being trained (with gradient), at the
        settings' sampling ``temperature`` unless given; 0 past each response."""
        t = self.config.temperature if temperature is None else temperature
        return self._columns(self.head.logprobs(t))

    def entropy(self, temperature: float | None = None) -> torch.Tensor:
        """[n, T]: entropy of the distribution that predicted each response token (with gradient)."""
        t = self.config.temperature if temperature is None else temperature
        return self._columns(self.head.entropy(t))

    def values(self) -> torch.Tensor:
        """[n, T]: a value head's V(state before response token t) (with gradient)."""
        return self._columns(self.head.values, shift=-1)


LossFn = Callable[[MiniBatch], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]
PrepareFn = Callable[[Rollout], Mapping[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A TRAIN_STEP interface's ``fn`` made of a loss function (see the module's docstring).

    ``loss_norm`` None: the settings' ``loss_norm`` field (as ``CriticFreeConfig``'s), else ``token``."""

    loss: LossFn
    stats: tuple[str, ...] = ()
    prepare: PrepareFn | None = None
    loss_norm: LossNorm | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise ValueError("TrainStep: loss must be a function (mb: MiniBatch) -> (loss, {stat: tensor})")
        if self.prepare is not None and not callable(self.prepare):
            raise ValueError("TrainStep: prepare must be a function (rollout: Rollout) -> {name: tensor}")
        if isinstance(self.stats, str) or not all(isinstance(s, str) and s.isidentifier() for s in self.stats):
            raise ValueError(f"TrainStep: stats must be a tuple of identifiers (the names the loss reports), got "
                             f"{self.stats!r}")
        object.__setattr__(self, "stats", tuple(self.stats))
        taken = sorted(set(self.stats) & {"loss", "grad_norm", "lr"})
        if taken:
            raise ValueError(f"TrainStep: stats {taken} would collide with what realloc reports itself (<model>_loss, "
                             f"<model>_grad_norm, <model>_lr); name them otherwise")
        if self.loss_norm is not None and self.loss_norm not in losses.LOSS_NORMS:
            raise ValueError(f"TrainStep: loss_norm must be one of {', '.join(losses.LOSS_NORMS)} or None, got "
                             f"{self.loss_norm!r}")

    def norm_of(self, config: Any) -> str:
        norm = self.loss_norm or getattr(config, "loss_norm", None) or "token"
        if norm not in losses.LOSS_NORMS:
            raise ValueError(f"loss_norm of the settings must be one of {', '.join(losses.LOSS_NORMS)}, got {norm!r}")
        return norm

    def __call__(self, ctx: CallContext, inputs: Data) -> CallResult:
        model = ctx.model
        assert model is not None and ctx.optimizer is not None
        where = f"call {ctx.call.name!r}"
        if "seq" not in inputs:
            raise ValueError(f"{where}: a TrainStep needs an input slot 'seq' (the sequences it trains on)")
        mask = inputs["seq"]["gen_mask"]
        n = mask.shape[0]
        extra = dict(self.prepare(Rollout(ctx, inputs))) if self.prepare is not None else {}
        for name, t in extra.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
                raise ValueError(f"{where}: prepare must return per-sequence tensors (first dimension {n}); "
                                 f"{name!r} is {_describe(t)}")
        norm = self.norm_of(ctx.config)
        M = ctx.call.n_minibatches
        mb_of_row = torch.tensor([i % M for i in ctx.ids], dtype=torch.long)
        local = torch.stack([torch.stack([mask[mb_of_row == k].sum().double(), (mb_of_row == k).sum().double()])
                             for k in range(M)])
        counts = dp_all_reduce(model, local)  # [M, (tokens, sequences)] of the whole mini-batches
        prefix = ctx.call.model_name
        sums = {f"{prefix}_loss": 0.0, **{f"{prefix}_{s}": 0.0 for s in self.stats}}
        grad_norm, lr0 = 0.0, None
        for k in range(M):
            rows = torch.nonzero(mb_of_row == k).view(-1)
            n_tok, n_seq = float(counts[k, 0]), float(counts[k, 1])
            mb = {**forward_batch({name: t[rows] for name, t in inputs["seq"].items()}), _ROWS: rows}
            parts: list[dict[str, float]] = []

            def loss_fn(head: Any, m: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
                r = m[_ROWS].cpu()
                dev = head.raw.device
                batch = MiniBatch(ctx, {role: {name: t[r].to(dev) for name, t in d.items()}
                                        for role, d in inputs.items()},
                                  head=head, extra={name: t[r].to(dev) for name, t in extra.items()})
                out = self.loss(batch)
                if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
                        and isinstance(out[1], Mapping)):
                    raise ValueError(f"{where}: the loss function must return (loss tensor, {{stat: tensor}}), got "
                                     f"{_describe(out)}")
                per, stats = out
                m_mask = batch.mask
                weights = self._weights(where, per, m_mask, norm, n_tok, n_seq, ctx.gen_len)
                # padding positions count for nothing, even where the loss function left a NaN or inf there
                loss = torch.where(weights > 0, per * weights, torch.zeros_like(per)).sum()
                if set(stats) != set(self.stats):
                    raise ValueError(f"{where}: the loss function reported stats {sorted(stats)}, but its TrainStep "
                                     f"declares {sorted(self.stats)}; report exactly the declared ones")
                with torch.no_grad():
                    got = {"loss": float(loss.detach())}
                    for name, v in stats.items():
                        got[name] = _stat_sum(where, name, v, m_mask) / (n_tok if v.dim() == 2 else n_seq or 1.0)
                parts.append(got)
                return loss, {}

            grad_norm += optimizer_step(ctx, split_batch(mb, ctx.n_mbs), loss_fn) / M
            lr0 = ctx.optimizer.param_groups[0]["lr"] if lr0 is None else lr0
            for name in ("loss", *self.stats):
                sums[f"{prefix}_{name}"] += sum(p[name] for p in parts) / M
        if not model.groups.is_last_stage:
            return CallResult({}, {}, {})
        return CallResult({}, sums, {f"{prefix}_grad_norm": grad_norm, f"{prefix}_lr": float(lr0)})

    @staticmethod
    def _weights(where: str, per: torch.Tensor, mask: torch.Tensor, norm: str, n_tok: float, n_seq: float,
                 gen_len: int) -> torch.Tensor:
        if per.dim() == 2 and per.shape == mask.shape:
            return losses.token_weights(mask, norm, n_tok, n_seq, gen_len).to(per.device, per.dtype)  # type: ignore[arg-type]
        if per.dim() == 1 and per.shape[0] == mask.shape[0]:
            return torch.full_like(per, 1.0 / max(n_seq, 1.0))
        raise ValueError(f"{where}: the loss function's loss has shape {tuple(per.shape)}; return one loss per "
                         f"response token {tuple(mask.shape)} or one per sequence ({mask.shape[0]},)")


def _stat_sum(where: str, name: str, v: Any, mask: torch.Tensor) -> float:
    if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == mask.shape:
        v = v.detach().double()
        return float(torch.where(mask.to(v.device), v, torch.zeros_like(v)).sum())
    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == mask.shape[0]:
        return float(v.detach().double().sum())
    raise ValueError(f"{where}: stat {name!r} is {_describe(v)}; a stat is one value per response token "
                     f"{tuple(mask.shape)} or one per sequence ({mask.shape[0]},)")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
