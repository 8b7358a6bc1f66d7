"""``ParallelModel``: one model instance in one (dp, tp, pp) layout, and the calls the runtime makes on it.

Build it on every rank of the layout's mesh, after the layout's process groups
exist (``ProcessGroupCache.ensure_layouts`` on every process of the world)::

    cache = ProcessGroupCache()
    layout = ModelLayout.for_model(cfg, (0, 1, 2, 3), ParallelStrategy(dp=1, tp=2, pp=2))
    cache.ensure_layouts([layout])                        # all processes, same order
    model = ParallelModel(cfg, cache.model_groups(layout), seed=1)   # ranks 0..3 only

Calls (each is collective over the model's mesh; every rank of a dp replica
gets the same batch, different dp replicas get different batches):

- ``train_step(micro_batches, loss_fn, optimizer)``: 1F1B over the micro-batches,
  tied-embedding sync, data-parallel gradient average, global-norm clipping, an
  optimizer step. ``loss_fn(out: HeadOutput, micro_batch) -> (loss, stats)`` runs on
  the last stage. Returns stats (see :meth:`ParallelModel.train_step`).
- ``forward(batch)``: per-token log-probs (actor) or values (critic), ``[B, T]``
  like ``input_ids``. Result on every tp rank of the last stage (``None`` on other
  stages), or on every rank with ``to_all_stages=True``.
- ``generate(prompts, gconfig, seq_ids, n_mbs)``: see ``generation.py``; result on every
  rank of the replica.

``train_step`` and ``forward`` pack each micro-batch's right-padded rows into fewer rows (``packing.py``;
``pack_sequences=False`` runs them padded); loss functions and results see the caller's ``[B, T]`` either way.

Precision: parameters live in ``dtype`` (fp32 on CPU; bf16 on GPUs). A bf16 model
accumulates micro-batch gradients in fp32 (or, with ``make_optimizer(grad_dtype=torch.bfloat16)``,
in bf16: 2 bytes per parameter less, and half the bytes in the dp reduction) and trains through
fp32 master weights (``make_optimizer`` returns ``optim.MasterWeightAdamW``); fp16 training is refused.
With dp > 1, ``make_optimizer`` returns the distributed optimizer (``zero.DistributedAdamW``,
both dtypes): the optimizer state is sharded over dp, gradients reduce-scatter and updated
parameters all-gather.

Parameters for reallocation and checkpoints: :meth:`params` maps HF names to
the local shards (the ``torch.nn.Parameter`` objects themselves, so writing
into them in place updates the model and keeps optimizer state attached).
``init="empty"`` allocates without initializing (a destination layout);
``release()``/``materialize()`` free and re-allocate the storage; host
offload of a frozen model is ``realloc.runtime.transfer.offload.HostOffload(model.params())``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from realloc.models import grads
from realloc.models.batch import Batch, TokenLayout, split_rows, token_layout, trim
from realloc.models.collective_wait import blocking
from realloc.models.config import ModelConfig
from realloc.models.generation import GenerationOutput, generate
from realloc.models.groups import ModelParallelGroups
from realloc.models.llama import LlamaStage
from realloc.models.lora import LoRAState, adapters_disabled, attach_adapters
from realloc.models.loss_scale import DynamicLossScale
from realloc.models.megatron_shim import prepare_device
from realloc.models.optim import MasterWeightAdamW
from realloc.models.packing import PackPlan, pack_layout, token_balanced_ranges
from realloc.models.param_layout import ParamSpec, stage_param_specs
from realloc.models.pipeline import ForwardStep, ShapeFn, StageLink, run_1f1b, run_forward_only
from realloc.models.sequence_parallel import TokenSplit
from realloc.models.vocab_parallel import gather_vocab, vocab_parallel_entropy, vocab_parallel_token_logprobs
from realloc.models.weights import init_shard, param_seed
from realloc.models.zero import DistributedAdamW

if TYPE_CHECKING:
    from realloc.models.sampling import GenerationConfig
    from realloc.models.turn_cache import TurnCache

ParamState = Literal["ready", "released"]


@dataclasses.dataclass
class HeadOutput:
    """What the last stage hands to a loss function for one micro-batch.

    ``raw`` is ``[B, T, V/tp]`` logits of this rank's shard of the padded vocabulary (padding columns -inf;
    ``config.py``) (actor) or
    ``[B, T]`` values (critic). The helpers return full-vocabulary quantities,
    identical on every tp rank, aligned with the scored token like ``forward()``.
    """

    raw: torch.Tensor
    layout: TokenLayout
    tp_group: dist.ProcessGroup
    is_critic: bool

    @property
    def values(self) -> torch.Tensor:
        if not self.is_critic:
            raise ValueError("HeadOutput.values: this model has a vocabulary head; use logprobs()")
        return self.raw.float() * (self.layout.segment_ids >= 0)

    @property
    def token_mask(self) -> torch.Tensor:
        """[B, T] True where a token is scored (it follows a token of its own sequence)."""
        m = torch.zeros(self.layout.shape, dtype=torch.bool, device=self.raw.device)
        m[:, 1:] = self.layout.next_token_valid()
        return m

    def _shifted(self, per_pos: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros_like(per_pos[:, :1])
        valid = self.layout.next_token_valid()
        return torch.cat([pad, torch.where(valid, per_pos, torch.zeros_like(per_pos))], dim=1)

    def _next_ids(self) -> torch.Tensor:
        """[B, T]: the token after each position (the last column wraps around and is never scored)."""
        return torch.roll(self.layout.input_ids, -1, dims=1)

    # logprobs() and entropy() score the whole [B, T, V/tp] logits and drop the last position afterwards, not
    # before: the vocabulary-parallel backward then writes d(logits) straight into one tensor of the logits'
    # shape, where a slice raw[:, :-1] would make autograd allocate a second, zero-padded one.
    def logprobs(self, temperature: float = 1.0) -> torch.Tensor:
        """[B, T]: log p(token t | tokens before t) under softmax(logits / temperature); 0 where not scored."""
        if self.is_critic:
            raise ValueError("HeadOutput.logprobs: a critic has no vocabulary head; use values")
        lp = vocab_parallel_token_logprobs(self.raw, self._next_ids(), self.tp_group, temperature)
        return self._shifted(lp[:, :-1])

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """[B, T]: entropy of the distribution that predicted token t; 0 where not scored."""
        if self.is_critic:
            raise ValueError("HeadOutput.entropy: a critic has no vocabulary head")
        return self._shifted(vocab_parallel_entropy(self.raw, self.tp_group, temperature)[:, :-1])


@dataclasses.dataclass
class PackedHeadOutput(HeadOutput):
    """A HeadOutput of a packed micro-batch (``packing.py``), seen in the caller's ``[B, T]`` shape.

    ``layout`` (and so ``token_mask``) is the caller's; ``raw`` is the packed ``[R, C, ...]`` output the
    per-token helpers compute on before they unpack, so loss functions see the unpacked meaning.
    """

    plan: PackPlan

    def _packed(self) -> HeadOutput:
        return HeadOutput(self.raw, self.plan.layout, self.tp_group, self.is_critic)

    @property
    def values(self) -> torch.Tensor:
        return self.plan.unpack(self._packed().values)

    # The helpers take HeadOutput's arguments as they are, so a new option of theirs reaches the packed rows.
    def logprobs(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.plan.unpack(self._packed().logprobs(*args, **kwargs))

    def entropy(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.plan.unpack(self._packed().entropy(*args, **kwargs))


def head_output(raw: torch.Tensor, layout: TokenLayout, plan: PackPlan | None, tp_group: dist.ProcessGroup,
                is_critic: bool) -> HeadOutput:
    """The loss functions' view of one micro-batch's head output, in the caller's ``layout``."""
    if plan is None:
        return HeadOutput(raw, layout, tp_group, is_critic)
    return PackedHeadOutput(raw, layout, tp_group, is_critic, plan)


LossFn = Callable[[HeadOutput, Mapping[str, torch.Tensor]], "tuple[torch.Tensor, Mapping[str, float]]"]


@dataclasses.dataclass(frozen=True)
class TrainPasses:
    """A begun train step (``ParallelModel.begin_train_step``): the passes a pipeline schedule runs, and what
    ``finish_train_step`` needs afterwards."""

    n_mbs: int
    forward_step: ForwardStep  # (micro-batch, input or None) -> output, or on the last stage the weighted loss
    activation_shape: ShapeFn  # what crosses stages for a micro-batch
    optimizer: Any
    distributed: bool
    max_grad_norm: float | None
    mb_stats: list[dict[str, float]]
    scaler: Any = None  # fp16's DynamicLossScale (loss_scale.py), or None
    scale: float = 1.0  # the loss scale the passes multiplied every loss by


class ParallelModel:
    def __init__(self, cfg: ModelConfig, groups: ModelParallelGroups, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, init: Literal["random", "empty"] = "random",
                 seed: int = 1, sequence_parallel: bool = True, pack_sequences: bool = True) -> None:
        if groups.layout.tie_embeddings != cfg.tie_embeddings:
            raise ValueError(f"model {cfg.name!r}: layout.tie_embeddings={groups.layout.tie_embeddings} must equal "
                             f"the config's tie_embeddings={cfg.tie_embeddings} (its groups depend on it)")
        if cfg.n_layers < groups.pp:
            raise ValueError(f"model {cfg.name!r}: pp={groups.pp} exceeds its {cfg.n_layers} layers")
        self.cfg = cfg
        self.groups = groups
        # forward() and train_step() pack each micro-batch's right-padded rows (packing.py); False runs
        # the padded rows as given (the comparison of benchmarks/bench_packing.py).
        self.pack_sequences = pack_sequences
        self.device = prepare_device(device)
        self.dtype = dtype
        # Sequence parallelism (sequence_parallel.py) for every tp > 1 train and forward call, as Megatron;
        # off only to compare against plain tp. Generation decodes without it.
        self.sequence_parallel = sequence_parallel and groups.tp > 1
        self.stage = LlamaStage(cfg, groups.pp, groups.pp_rank, groups.tp_group, dtype, self.device)
        # LoRA (lora.py): adapters on the block's linears, the base frozen; the same dropout seed on every tp
        # rank of a (dp, pp) coordinate, so they drop the same inputs
        self.lora: LoRAState | None = None
        if cfg.lora is not None:
            self.lora = attach_adapters(self.stage, cfg, groups.tp_group, dtype, self.device,
                                        param_seed(seed, f"lora-dropout/dp{groups.dp_rank}/pp{groups.pp_rank}"))
        if groups.layout.kv_replicas != cfg.kv_replicas(groups.tp):
            raise ValueError(f"model {cfg.name!r}: layout.kv_replicas={groups.layout.kv_replicas} must be "
                             f"{cfg.kv_replicas(groups.tp)} ({cfg.n_kv_heads} KV heads at tp={groups.tp}); build the "
                             f"layout with ModelLayout.for_model")
        self.specs: dict[str, ParamSpec] = {s.name: s for s in stage_param_specs(cfg, groups.pp, groups.pp_rank)}
        self._params: dict[str, torch.nn.Parameter] = dict(self.stage.named_parameters())
        # what train steps update: all parameters, or with LoRA the adapters (and a critic's head)
        self._trained: dict[str, torch.nn.Parameter] = {n: p for n, p in self._params.items() if p.requires_grad}
        self._check_contract()
        self.state: ParamState = "ready"
        # bf16 models accumulate micro-batch gradients in fp32 (or bf16: the optimizer's grad_dtype) buffers
        # that exist only during train_step; the hook moves each fresh low-precision gradient into them.
        self._low_precision = dtype != torch.float32
        self._main_grads: dict[str, torch.Tensor] | None = None
        if self._low_precision:
            for name, p in self._trained.items():
                p.register_post_accumulate_grad_hook(self._accumulate_hook(name))
        if init == "random":
            self.init_random(seed)
        elif init != "empty":
            raise ValueError(f"ParallelModel: init must be 'random' or 'empty', got {init!r}")

    # -- parameters -------------------------------------------------------------------------------

    def _check_contract(self) -> None:
        tp = self.groups.tp
        got = {n: tuple(p.shape) for n, p in self._params.items()}
        want = {n: s.shard_shape(tp) for n, s in self.specs.items()}
        assert got == want, f"stage parameters differ from param_layout: {sorted(set(got) ^ set(want))} {got} {want}"

    def params(self) -> dict[str, torch.nn.Parameter]:
        """HF name -> this rank's shard (``full[spec.shard_slices(tp, tp_rank)]``), the live Parameters."""
        return dict(self._params)

    def trained_params(self) -> dict[str, torch.nn.Parameter]:
        """The parameters a train step updates: all of ``params()``, or with LoRA its adapters (and a critic's
        scalar head)."""
        return dict(self._trained)

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Run the base model, LoRA adapters off (a LoRA actor's reference); a no-op without LoRA."""
        if self.lora is None:
            yield
            return
        with adapters_disabled(self.lora):
            yield

    def _accumulate_hook(self, name: str) -> Callable[[torch.nn.Parameter], None]:
        def hook(p: torch.nn.Parameter) -> None:
            if self._main_grads is not None:
                self._main_grads[name].add_(p.grad)
                p.grad = None
        return hook

    def _require(self, state: ParamState, call: str) -> None:
        if self.state != state:
            raise RuntimeError(f"ParallelModel.{call}: parameters are {self.state}, expected {state}; "
                               f"call materialize() or reload() first")

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Deterministic init: the same seed gives the same full model in every layout (``weights.py``)."""
        self._require("ready", "init_random")
        for name, p in self._params.items():
            p.copy_(init_shard(self.specs[name], seed, self.groups.tp, self.groups.tp_rank, self.dtype))

    @torch.no_grad()
    def load_full_state(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's slices out of full (unsharded) tensors keyed by HF name, with or without the
        vocabulary padding rows (``ParamSpec.hf_shape``: an HF state dict; ``shape``: the engine's)."""
        self._require("ready", "load_full_state")
        missing = sorted(set(self._params) - set(full))
        if missing:
            raise ValueError(f"load_full_state: missing parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for name, p in self._params.items():
            spec = self.specs[name]
            t = full[name]
            if tuple(t.shape) == spec.hf_shape:
                t = spec.pad(t)
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"load_full_state: {name} has shape {tuple(t.shape)}, expected {spec.hf_shape}"
                                 f"{f' or, padded, {spec.shape}' if spec.pad_rows else ''}")
            p.copy_(t[spec.shard_slices(self.groups.tp, self.groups.tp_rank)])

    def release(self) -> None:
        """Free parameter storage (e.g. this layout is not used until the next reallocation)."""
        for p in self._params.values():
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            p.grad = None
        self.state = "released"

    def materialize(self) -> None:
        """Allocate storage again, uninitialized; the caller fills it (reallocation, checkpoint)."""
        self._require("released", "materialize")
        for name, p in self._params.items():
            p.data = torch.empty(self.specs[name].shard_shape(self.groups.tp), dtype=self.dtype, device=self.device)
        self.state = "ready"

    def make_optimizer(self, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                       eps: float = 1e-8, *, grad_dtype: torch.dtype = torch.float32
                       ) -> "torch.optim.AdamW | MasterWeightAdamW | DistributedAdamW":
        """AdamW over the local shards; norms are not decayed. Its state is per rank and never moves.

        With dp > 1, :class:`DistributedAdamW` (state sharded over dp; fp32 master chunks for bf16 models).
        Otherwise fp32 models get ``torch.optim.AdamW``; bf16 models get :class:`MasterWeightAdamW` (fp32
        master weights). ``grad_dtype`` (bf16 models only) is the dtype of the gradient accumulation
        buffers ``train_step`` fills for this optimizer: ``torch.bfloat16`` is Megatron's
        ``grad_reduce_in_fp32=False`` (``TrainConfig.grad_dtype``).
        """
        if grad_dtype != torch.float32 and not self._low_precision:
            raise ValueError(f"make_optimizer: grad_dtype={grad_dtype} needs a bf16 model; this one is {self.dtype} "
                             f"and keeps fp32 gradients (set grad_dtype to fp32)")
        trained = self._trained
        opt: MasterWeightAdamW | DistributedAdamW | None = None
        if self.groups.dp > 1:
            opt = DistributedAdamW(trained, self.groups.dp_group, lr, weight_decay, betas, eps,
                                   masters=self._low_precision, grad_dtype=grad_dtype)
        elif self._low_precision:
            opt = MasterWeightAdamW(trained, lr, weight_decay, betas, eps, grad_dtype=grad_dtype)
        if opt is not None:
            opt.loss_scale = DynamicLossScale() if self.dtype == torch.float16 else None
            return opt
        decay = [p for n, p in trained.items() if p.dim() >= 2]
        no_decay = [p for n, p in trained.items() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                                 foreach=False)  # bounded temporaries, as MasterWeightAdamW

    # -- helpers ----------------------------------------------------------------------------------

    def _split(self, layout: TokenLayout) -> TokenSplit | None:
        if not self.sequence_parallel:
            return None
        b, t = layout.shape
        return TokenSplit(self.groups.tp_group, b, t)

    def _hidden_shape(self, layout: TokenLayout) -> tuple[int, ...]:
        """What one stage sends the next: ``[B, T, h]``, or the rank's ``[local, h]`` tokens under sequence
        parallelism (1/tp of the bytes)."""
        split = self._split(layout)
        if split is not None:
            return split.local_shape(self.cfg.hidden_size)
        b, t = layout.shape
        return (b, t, self.cfg.hidden_size)

    def _stage_forward(self, layout: TokenLayout, x: torch.Tensor | None, recompute: bool = False) -> torch.Tensor:
        inputs = layout.input_ids if self.groups.is_first_stage else x
        return self.stage(inputs, layout.position_ids, layout.attention_mask(), recompute=recompute,
                          split=self._split(layout))

    def _pack(self, layout: TokenLayout) -> PackPlan | None:
        return pack_layout(layout) if self.pack_sequences else None

    def _to_device(self, mb: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}

    # -- training ---------------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn, optimizer: torch.optim.Optimizer, *,
                   max_grad_norm: float | None = None, loss_weights: Sequence[float] | None = None,
                   recompute: bool = False) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (this dp replica's share of the global batch).

        The gradient is ``mean over dp replicas of sum_i loss_weights[i] * grad(loss_i)``; weights
        default to ``1 / len(micro_batches)``. ``recompute`` keeps only each decoder layer's input
        for the backward and runs the layer's forward again there: one more forward of the layers
        buys activation memory at layer boundaries only, with the same gradients.
        Returns on every rank ``grad_norm`` (before clipping)
        and ``skipped`` (1.0 when the norm was not finite and the update was skipped); on last-stage
        ranks also ``loss`` and the loss function's stats, averaged over micro-batches and dp replicas.

        It is ``begin_train_step``, the passes (1F1B), ``finish_train_step``; ``fused_train.py`` runs two models'
        passes in one fused schedule between the same two halves.
        """
        run = self.begin_train_step(micro_batches, loss_fn, optimizer, max_grad_norm=max_grad_norm,
                                    loss_weights=loss_weights, recompute=recompute)
        try:
            with torch.enable_grad():
                if self.groups.pp == 1:
                    for i in range(run.n_mbs):
                        torch.autograd.backward(run.forward_step(i, None))
                else:
                    run_1f1b(self.stage_link(), run.n_mbs, run.forward_step, run.activation_shape)
        except BaseException:
            self.abandon_train_step()
            raise
        return self.finish_train_step(run)

    def stage_link(self, tag_offset: int = 0) -> StageLink:
        """This rank's point-to-point link to its neighbouring stages (``tag_offset``: a second model's
        messages on the same devices, fused_pipeline.py)."""
        return StageLink(self.groups, self.device, self.dtype, tag_offset=tag_offset)

    def begin_train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn, optimizer: torch.optim.Optimizer, *,
                         max_grad_norm: float | None = None, loss_weights: Sequence[float] | None = None,
                         recompute: bool = False) -> "TrainPasses":
        """The first half of :meth:`train_step`: checks, packing, fresh gradient buffers; returns the passes to
        run. Run them (each micro-batch's forward, then ``torch.autograd.backward`` of what it returned, in
        micro-batch order), then call ``finish_train_step`` (or ``abandon_train_step`` on failure)."""
        self._require("ready", "train_step")
        scaler = getattr(optimizer, "loss_scale", None)  # fp16 only (loss_scale.py)
        if self.dtype == torch.float16 and scaler is None:
            raise ValueError("train_step: a float16 model trains with loss scaling; pass model.make_optimizer()")
        scale = scaler.scale if scaler is not None else 1.0
        distributed = isinstance(optimizer, DistributedAdamW)
        if distributed and (optimizer.params.keys() != self._trained.keys() or optimizer.dp != self.groups.dp):
            raise ValueError("train_step: the DistributedAdamW was made for another model; pass model.make_optimizer()")
        masters = isinstance(optimizer, MasterWeightAdamW) or (distributed and optimizer.keeps_masters)
        if self._low_precision and not masters:
            raise ValueError(f"train_step: a {self.dtype} model needs fp32 master weights; pass model.make_optimizer()")
        n = len(micro_batches)
        if n == 0:
            raise ValueError("train_step: micro_batches is empty")
        weights = [1.0 / n] * n if loss_weights is None else [float(w) for w in loss_weights]
        if len(weights) != n:
            raise ValueError(f"train_step: {len(weights)} loss_weights for {n} micro-batches")
        mbs = [self._to_device(mb) for mb in micro_batches]
        layouts = [token_layout(mb, f"train_step micro-batch {i}", self.cfg.max_position_embeddings)
                   for i, mb in enumerate(mbs)]
        # What the stages run: every stage derives the same packed shapes from the same lengths.
        plans = [self._pack(lay) for lay in layouts]
        runs = [lay if p is None else p.layout for lay, p in zip(layouts, plans)]
        g = self.groups
        mb_stats: list[dict[str, float]] = []

        def step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            out = self._stage_forward(runs[i], x, recompute)
            if not g.is_last_stage:
                return out
            loss, stats = loss_fn(head_output(out, layouts[i], plans[i], g.tp_group, self.cfg.is_critic), mbs[i])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("train_step: loss_fn must return (scalar loss tensor, stats dict)")
            mb_stats.append({"loss": float(loss.detach()), **{k: float(v) for k, v in dict(stats).items()}})
            return loss * (weights[i] * scale)

        if not self.stage.training:  # train() walks every module; the stage is only switched as a whole
            self.stage.train()
        trained = self._trained
        for p in trained.values():
            p.grad = None
        if self._low_precision:
            # masters is true here, so the optimizer is one of ours and says which buffers it steps from
            self._main_grads = {name: torch.zeros(p.shape, dtype=optimizer.grad_dtype, device=self.device)
                                for name, p in trained.items()}
        return TrainPasses(n, step, lambda i: self._hidden_shape(runs[i]), optimizer, distributed, max_grad_norm,
                           mb_stats, scaler, scale)

    def finish_train_step(self, run: "TrainPasses") -> dict[str, float]:
        """The second half of :meth:`train_step`, after every pass ran: gradient reductions, clipping, the
        optimizer step; returns train_step's stats."""
        g, trained, optimizer, distributed = self.groups, self._trained, run.optimizer, run.distributed
        scaler, scale = run.scaler, run.scale
        try:
            if self._main_grads is not None:
                main = self._main_grads
            else:
                grads.ensure_grads(trained)
                main = grads.param_grads(trained)
            if scale != 1.0:
                for t in main.values():
                    t.div_(scale)  # an overflow stays inf: the norm below is not finite, and the step is skipped
            if self.sequence_parallel:
                grads.sync_sequence_parallel(main, self.specs, g)
            elif self.cfg.qk_norm:
                grads.sync_head_norms(main, g)
            if self.cfg.tie_embeddings and "model.embed_tokens.weight" in main:  # frozen under LoRA
                grads.sync_tied_embedding(main, g, "model.embed_tokens.weight")
            grads.sync_kv_replicas(main, self.specs, g)
            if distributed:
                # each dp rank reduces, clips and steps only its chunks (zero.py)
                main = optimizer.reduce_scatter_grads(main)
            else:
                grads.average_data_parallel(main, g)
            norm = grads.global_norm(main, self.specs, g, dp_chunks=distributed)
            finite = math.isfinite(norm)
            if scaler is not None:
                scaler.update(finite)
            if finite:
                if run.max_grad_norm is not None:
                    grads.clip_(main, norm, run.max_grad_norm)
                if isinstance(optimizer, (MasterWeightAdamW, DistributedAdamW)):
                    optimizer.step_with(main)
                else:
                    optimizer.step()
        finally:
            self.abandon_train_step()
        out = {"grad_norm": norm, "skipped": 0.0 if finite else 1.0}
        if g.is_last_stage:
            out.update(self._mean_stats(run.mb_stats))
        return out

    def abandon_train_step(self) -> None:
        """Drop what a begun train step holds (gradients, fp32 gradient buffers, LoRA's saved inputs)."""
        self._main_grads = None
        if self.lora is not None:
            self.lora.clear()
        for p in self._trained.values():
            p.grad = None

    def _mean_stats(self, mb_stats: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted(mb_stats[0])
        if any(sorted(s) != keys for s in mb_stats):
            raise ValueError("train_step: loss_fn must return the same stats keys for every micro-batch")
        local = torch.tensor([sum(s[k] for s in mb_stats) / len(mb_stats) for k in keys], dtype=torch.float64)
        if self.groups.dp > 1:
            # Same loss_fn on every dp replica, so the keys agree and one all-reduce averages them.
            local = local.to(self.device)
            blocking(dist.all_reduce, local, group=self.groups.dp_group)
            local = local.cpu() / self.groups.dp
        return dict(zip(keys, local.tolist()))

    # -- inference --------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: Batch, *, n_mbs: int = 1,
                output: Literal["logprobs", "values", "entropy", "logits"] | None = None,
                temperature: float = 1.0, to_all_stages: bool = False) -> torch.Tensor | None:
        """Per-token outputs ``[B, T]`` (float32) for this dp replica's batch, zeros where undefined.

        ``output`` defaults to "values" for critics and "logprobs" for actors (see ``batch.py``
        for the alignment); "entropy" is aligned like log-probs; "logits" returns the raw
        full-vocabulary logits ``[B, T, V]`` at each position (gathered over tp: debugging and
        tests, not for large vocabularies). ``n_mbs`` micro-batches stream through the
        pipeline; each is trimmed to its longest row. With ``pack_sequences``, right-padded rows split
        into micro-batches of near-equal tokens (contiguous rows) and each micro-batch runs packed
        (``packing.py``); the results keep the batch's shape and meaning.
        """
        self._require("ready", "forward")
        output = output or ("values" if self.cfg.is_critic else "logprobs")
        if output not in ("logprobs", "values", "entropy", "logits"):
            raise ValueError(f"forward: output must be 'logprobs', 'values', 'entropy' or 'logits', got {output!r}")
        if (output == "values") != self.cfg.is_critic:
            raise ValueError(f"forward: output={output!r} does not fit a "
                             f"{'critic' if self.cfg.is_critic else 'vocabulary'} head")
        full = token_layout(batch, "forward", self.cfg.max_position_embeddings).to(self.device)
        ranges = split_rows(full, n_mbs)
        if self.pack_sequences and full.causal_suffices:
            ranges = token_balanced_ranges((full.segment_ids >= 0).sum(dim=1).tolist(), n_mbs)
        parts = [trim(TokenLayout(full.input_ids[lo:hi], full.position_ids[lo:hi], full.segment_ids[lo:hi]))
                 for lo, hi in ranges]
        plans = [self._pack(lay) for lay, _ in parts]
        runs = [lay if p is None else p.layout for (lay, _), p in zip(parts, plans)]
        g = self.groups
        if self.stage.training:
            self.stage.eval()

        def step(i: int, x: torch.Tensor | None) -> torch.Tensor:
            lay, plan = parts[i][0], plans[i]
            out = self._stage_forward(runs[i], x)
            if not g.is_last_stage:
                return out
            head = head_output(out, lay, plan, g.tp_group, self.cfg.is_critic)
            if output == "values":
                return head.values
            if output == "logits":
                real = gather_vocab(out, g.tp_group)[..., :self.cfg.vocab_size].float()  # the vocabulary padding goes
                real = real * (runs[i].segment_ids >= 0).unsqueeze(-1)
                return real if plan is None else plan.unpack(real)
            if output == "entropy":
                return head.entropy(temperature)
            return head.logprobs(temperature)

        if g.pp == 1:
            outs = [step(i, None) for i in range(len(parts))]
        else:
            outs = run_forward_only(self.stage_link(), len(parts), step, lambda i: self._hidden_shape(runs[i]))
        shape = full.shape + ((self.cfg.vocab_size,) if output == "logits" else ())
        result = None
        if g.is_last_stage:
            result = torch.zeros(shape, dtype=torch.float32, device=self.device)
            for (lo, hi), (_, width), o in zip(ranges, parts, outs):
                result[lo:hi, :width] = o
        if to_all_stages and g.pp > 1:
            if result is None:
                result = torch.empty(shape, dtype=torch.float32, device=self.device)
            dist.broadcast(result, src=g.last_stage_rank, group=g.pp_group)
        return result

    def generate(self, prompts: "Sequence[Sequence[int]] | Batch", gconfig: "GenerationConfig",
                 seq_ids: Sequence[int] | None = None, n_mbs: int = 1,
                 max_in_flight: int | None = None, turn_cache: "TurnCache | None" = None) -> GenerationOutput:
        """Sample continuations; see :func:`realloc.models.generation.generate`."""
        self._require("ready", "generate")
        return generate(self, prompts, gconfig, seq_ids, n_mbs, max_in_flight, turn_cache)
