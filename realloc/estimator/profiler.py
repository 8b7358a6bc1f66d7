"""Measure realloc's own model layers on this process's device (the worker side of ``realloc profile``).

Every op runs the real modules of ``realloc.models`` (megatron-core TP layers,
our attention, KV cache, vocab-parallel log-probs and sampling) on a one-layer
``ParallelModel`` of the profiled architecture, tensor-parallel over the tp
ranks that call these functions together. Times are per device:

- ``<part>.fwd``: inference forward (no autograd) of ``b`` sequences x ``s`` tokens;
- ``<part>.bwd``: the rest of a training micro-batch, i.e. (forward with autograd
  + backward) minus ``fwd``, so that fwd + bwd is one micro-batch of training;
- ``<part>.prefill``: forward of ``b`` prompts of ``s`` tokens that fills a KV
  cache (the head: last-position logits, vocabulary gather, sampling);
- ``<part>.decode``: one token for ``b`` sequences attending ``s`` cached
  positions (the head: logits, gather, sampling, as ``generation.py`` runs it).
  A decode step streams every layer's weights for little work, so a layer is
  faster when its weights are still in the CPU's caches from the last repeat:
  the block is timed as a stack of ``DECODE_STACK`` distinct layers (at most
  the model's depth) and divided by their number, as a real model runs them;
- optimizer: one update of the model's own optimizer (``make_optimizer``) over
  the parameters of 1, 2 and 4 layers;
- engine overheads (``ENGINE_KEYS``): what real ``ParallelModel`` calls take
  beyond the layer ops above (layouts, masks, the train step's bookkeeping, the
  generation loop), and interface overheads (``INTERFACE_KEYS``): what PPO's
  interfaces take beyond the engine calls they make.

Each point: ``warmup`` untimed runs, then ``repeats`` timed samples whose time is
the maximum over the tp ranks (they end together anyway because of the
collectives inside); the median is stored. Over tp > 1 a sample averages
consecutive runs (``timed``): collective latency is heavy-tailed, and calls pay
its mean. ``torch.set_num_threads(1)``: one
device is one single-threaded process, as in the runtime.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import statistics
import time
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from realloc.estimator.opcount import Part, Phase
from realloc.models.config import ModelConfig

if TYPE_CHECKING:
    from realloc.models.sequence_parallel import TokenSplit


@dataclasses.dataclass(frozen=True)
class LayerGrid:
    batch: tuple[int, ...]
    seq: tuple[int, ...]  # tokens per sequence for fwd/bwd/prefill
    ctx: tuple[int, ...]  # cached positions for decode
    warmup: int = 2
    repeats: int = 7


# Over a tensor-parallel group, one execution of a short op is dominated by its collectives, whose
# latency on gloo is heavy-tailed (a blocked process's wake-up): a single run costs 1x or 3x.
# A real call runs such ops back to back and pays their mean, so on a group each sample is the
# mean of enough consecutive runs to last GROUP_SAMPLE_SECONDS (at most GROUP_MAX_RUNS).
GROUP_SAMPLE_SECONDS = 0.005
GROUP_MAX_RUNS = 16


def _no_sync() -> None:
    return None


def graphed(run: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``run`` captured as a CUDA graph, returned as its replay: the runtime replays its decode steps so
    (``models/static_decode.py``), and a graph's time is its kernels' without the host's launches."""
    from realloc.models.static_decode import capture_graph

    return capture_graph(run, device).replay


def timed(run: Callable[[], object], group: dist.ProcessGroup | None, warmup: int, repeats: int,
          setup: Callable[[], object] | None = None, clock: Callable[[], float] = time.perf_counter,
          statistic: Callable[[list[float]], float] = statistics.median) -> float:
    """Median seconds of ``run()`` over ``repeats`` samples, each the max over ``group`` (a sample over a
    group of 2+ is the mean of consecutive runs, see GROUP_SAMPLE_SECONDS); ``setup()`` runs untimed
    before every run. ``clock``: wall time, or ``time.process_time`` (this process's CPU time, which other
    processes on a shared machine do not inflate; meaningful at tp 1, where nothing waits for a peer).
    ``statistic``: of the samples, the median, or ``min`` (``--clock wall-min``: another process can only add wall
    time to a sample, so the fastest one is the op's own)."""
    multi = group is not None and group.size() > 1
    # A GPU runs kernels after the host queued them: wait for the device before and after each timed run,
    # or the clock measures the launches only.
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else _no_sync
    last = 0.0
    for _ in range(warmup):
        if setup:
            setup()
        sync()
        t0 = clock()
        run()
        sync()
        last = clock() - t0
    runs = 1
    if multi:
        # every rank must run the op the same number of times (its collectives pair up)
        t = torch.tensor([last], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        runs = max(1, min(GROUP_MAX_RUNS, math.ceil(GROUP_SAMPLE_SECONDS / max(float(t[0]), 1e-9))))
    times = []
    for _ in range(repeats):
        if multi:
            dist.barrier(group=group)
        total = 0.0
        for _ in range(runs):
            if setup:
                setup()
            sync()
            t0 = clock()
            run()
            sync()
            total += clock() - t0
        times.append(total / runs)
    if multi:
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times = t.tolist()
    return statistic(times)


def release_free_memory() -> None:
    """Hand the heap's free memory back to the operating system (glibc's ``malloc_trim``; nothing elsewhere, and
    nothing for a GPU's caching allocator, which keeps its blocks): the next large allocation faults its pages in
    again, as one does in a worker after the calls before it freed theirs."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


# Distinct layers a decode step of the block is timed over (see the module docstring): measured on
# a 2-core x86 machine, a small-model layer's decode step at batch 32 takes 1.36 ms alone and
# 1.56 / 1.62 / 1.63 ms per layer in stacks of 2 / 4 / 8 layers, as in an 8-layer generate().
DECODE_STACK = 8


class LayerProfiler:
    """Builds one-layer models of ``cfg`` (actor and critic heads) on this tp group and times their parts."""

    def __init__(self, cfg: ModelConfig, groups, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter,
                 statistic: Callable[[list[float]], float] = statistics.median) -> None:
        from realloc.models.engine import ParallelModel

        one = cfg.with_layers(1, is_critic=False, tie_embeddings=False)
        self.cfg = one
        self.groups = groups
        self.group = groups.tp_group
        self.actor = ParallelModel(one, groups, device=device, dtype=dtype, seed=1)
        self.critic = ParallelModel(one.as_critic(), groups, device=device, dtype=dtype, seed=2)
        self.device, self.dtype = self.actor.device, dtype
        self.clock, self.statistic = clock, statistic  # timed()'s clock and statistic for every op
        self.stage = self.actor.stage
        self.layer = self.stage.layers[0]
        self.n_stack = max(1, min(cfg.n_layers, DECODE_STACK))
        self._stack = None

    def stack_model(self):
        """A model of ``n_stack`` layers (built on first use): its layers time a decode step, and its
        generate() the generation loop's overheads, layer caches as in a real model."""
        if self._stack is None:
            from realloc.models.engine import ParallelModel

            self._stack = ParallelModel(self.cfg.with_layers(self.n_stack), self.groups,
                                        device=self.device, dtype=self.dtype, seed=4)
        return self._stack

    # -- inputs ---------------------------------------------------------------
    def _ids(self, b: int, s: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(b * 7919 + s)
        return torch.randint(0, self.cfg.vocab_size, (b, s), generator=g).to(self.device)

    def _hidden(self, b: int, s: int, grad: bool = False, split: TokenSplit | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(b * 104729 + s)
        shape = split.local_shape(self.cfg.hidden_size) if split is not None else (b, s, self.cfg.hidden_size)
        x = torch.randn(shape, generator=g, dtype=torch.float32).to(self.device, self.dtype)
        return x.requires_grad_(grad)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from realloc.models.llama import rope_cos_sin

        return rope_cos_sin(self.stage.inv_freq, pos, self.dtype)

    def _seq_inputs(self, b: int, s: int):
        from realloc.models.llama import segment_mask

        pos = torch.arange(s, device=self.device).expand(b, s)
        mask = segment_mask(torch.zeros(b, s, dtype=torch.long, device=self.device))
        return pos, mask

    def _free_grads(self) -> None:
        for m in (self.actor, self.critic):
            for p in m.stage.parameters():
                p.grad = None

    # -- ops --------------------------------------------------------------------
    def op_runner(self, part: Part, phase: Phase, b: int, s: int) -> tuple[Callable[[], object],
                                                                          Callable[[], object] | None]:
        """(run, setup) for one op; ``run`` is what gets timed."""
        from realloc.models.llama import cache_mask
        from realloc.models.sampling import GenerationConfig, sample_tokens, sequence_generators
        from realloc.models.sequence_parallel import TokenSplit
        from realloc.models.vocab_parallel import gather_vocab, vocab_parallel_token_logprobs

        group, stage = self.group, self.stage
        train = phase is Phase.BWD
        if phase in (Phase.FWD, Phase.BWD):
            ids, (pos, mask) = self._ids(b, s), self._seq_inputs(b, s)
            cos, sin = self._rope(pos)
            # whole sequences run sequence parallel at tp > 1, as ParallelModel's train and forward calls do
            split = TokenSplit(group, b, s) if group is not None and group.size() > 1 else None
            if part is Part.EMBED:
                def fn():
                    out = stage.embed(ids, split)
                    if train:
                        out.backward(torch.ones_like(out))
            elif part is Part.BLOCK:
                x = self._hidden(b, s, grad=train, split=split)

                def fn():
                    out = self.layer(x, cos, sin, mask, None, 0, split)
                    if train:
                        out.backward(torch.ones_like(out))
            elif part is Part.HEAD:
                h = self._hidden(b, s, grad=train, split=split)

                def fn():
                    lp = vocab_parallel_token_logprobs(stage.head(h, split)[:, :-1], ids[:, 1:], group)
                    if train:
                        lp.mean().backward()
            else:
                h = self._hidden(b, s, grad=train, split=split)
                critic = self.critic.stage

                def fn():
                    v = critic.head(h, split).float()
                    if train:
                        v.mean().backward()
            if train:
                return fn, self._free_grads

            def no_grad():
                with torch.no_grad():
                    fn()
            return no_grad, None

        # PREFILL / DECODE: s = prompt length (prefill) or cached positions (decode)
        new = s if phase is Phase.PREFILL else 1
        start = 0 if phase is Phase.PREFILL else s - 1
        if part is Part.EMBED:
            ids = self._ids(b, new)

            def run():
                with torch.no_grad():
                    stage.embed(ids)
            if phase is Phase.DECODE and self.device.type == "cuda":
                return graphed(run, self.device), None  # inside the decode step's graph at run time
            return run, None
        if part is Part.BLOCK:
            x = self._hidden(b, new)
            owner = self.stack_model().stage if phase is Phase.DECODE else stage
            layers = owner.layers if phase is Phase.DECODE else [self.layer]
            caches = owner.new_kv_caches(b, s)
            pos = (torch.arange(new, device=self.device) + start).expand(b, new)
            cos, sin = self._rope(pos)
            mask = cache_mask(torch.ones(b, s, dtype=torch.bool, device=self.device), start, new)

            if phase is Phase.DECODE and self.device.type == "cuda":
                # as the runtime decodes on a GPU: the step's shapes fixed, the slot a device tensor, replayed
                # as a CUDA graph (static_decode.py); the whole cache is attended under the mask
                slot = torch.full((1,), start, dtype=torch.long, device=self.device)

                def step():
                    with torch.no_grad():
                        h = x
                        for layer, cache in zip(layers, caches):
                            h = layer(h, cos, sin, mask, cache, slot)
                return graphed(step, self.device), None

            def run():
                with torch.no_grad():
                    h = x
                    for layer, cache in zip(layers, caches):
                        h = layer(h, cos, sin, mask, cache, start)
            return run, None
        if part is Part.HEAD:
            h = self._hidden(b, 1)
            gcfg = GenerationConfig(max_new_tokens=1)
            gens = sequence_generators(0, range(b))
            vocab = self.cfg.vocab_size

            def run():
                with torch.no_grad():
                    logits = gather_vocab(stage.head(h[:, -1:]), group)[:, 0, :vocab].float()  # as generation
                    sample_tokens(logits, gcfg, gens)
            return run, None
        h = self._hidden(b, 1)
        critic = self.critic.stage

        def run():
            with torch.no_grad():
                critic.head(h)
        return run, None

    def timed(self, run: Callable[[], object], warmup: int, repeats: int,
              setup: Callable[[], object] | None = None) -> float:
        return timed(run, self.group, warmup, repeats, setup, self.clock, self.statistic)

    def time_op(self, part: Part, phase: Phase, b: int, s: int, warmup: int, repeats: int) -> float:
        run, setup = self.op_runner(part, phase, b, s)
        if (part, phase) == (Part.BLOCK, Phase.DECODE):
            return self.timed(run, warmup, repeats, setup) / self.n_stack
        if phase is not Phase.BWD:
            return self.timed(run, warmup, repeats, setup)
        total = self.timed(run, warmup, repeats, setup)
        fwd_run, _ = self.op_runner(part, Phase.FWD, b, s)
        fwd = self.timed(fwd_run, warmup, repeats)
        # never below a tenth of the total: the two medians are of noisy runs
        return max(total - fwd, 0.1 * total)

    # -- the engine's calls ------------------------------------------------------
    def _batch(self, b: int, s: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self._ids(b, s), "lengths": torch.full((b,), s, dtype=torch.long)}

    def time_engine(self, kind: str, b: int, s: int, warmup: int, repeats: int) -> dict[str, float]:
        """Overheads of one engine call beyond its layer ops, which ``layer(key, b, s)`` must return
        (the medians this profiler measured for the same point)."""
        from realloc.models.sampling import GenerationConfig

        model = self.actor
        if kind == "forward":
            batch = self._batch(b, s)
            t = self.timed(lambda: model.forward(batch), warmup, repeats)
            return {"engine.fwd": t}
        if kind == "train":
            opt = model.make_optimizer(lr=1e-9)

            def loss_fn(out, mb):
                return out.logprobs().mean(), {}

            one, two = [self._batch(b, s)], [self._batch(b, s), self._batch(b, s)]
            t1 = self.timed(lambda: model.train_step(one, loss_fn, opt, max_grad_norm=1.0), warmup, repeats)
            t2 = self.timed(lambda: model.train_step(two, loss_fn, opt, max_grad_norm=1.0), warmup, repeats)
            return {"train1": t1, "train2": t2}
        if kind == "generate":
            # on the stack model, whose decode steps the layer table prices (``layers`` of them)
            prompts = self._ids(b, s).tolist()
            gen_model = self.stack_model()
            out = {"layers": float(self.n_stack)}
            for n in GEN_TOKENS:
                cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n)
                out[f"gen{n}"] = self.timed(lambda: gen_model.generate(prompts, cfg), warmup, repeats)
            return out
        if kind == "ppo_train":
            return self.time_ppo_train(b, s, warmup, repeats)
        if kind == "row_drop_used":
            return {"engine.row_drop_used": self.time_row_drop(b, s, warmup, repeats, used=s)}
        if kind == "kv_touch":
            return {"engine.kv_touch": self.time_kv_touch(b, s, warmup, repeats)}
        if kind == "schedule":
            return self.time_schedule(b, warmup, repeats)
        raise ValueError(f"unknown engine call {kind!r}")

    def time_row_drop(self, b: int, slots: int, warmup: int, repeats: int, used: int | None = None) -> float:
        """Seconds per layer of what ``generation._MicroBatch.apply`` does when rows of a micro-batch finish and
        others run on: ``generation.drop_rows`` keeping ``b`` of ``b + 1`` rows of caches of ``slots`` positions,
        on the stack model's caches (one per layer, as the generation holds them); with ``used``, as the runtime
        calls it, moving only the written slots [0, used) in place (``engine.row_drop_used``)."""
        from realloc.models.generation import drop_rows

        stack = self.stack_model().stage
        caches = stack.new_kv_caches(b + 1, slots)
        keep = torch.ones(b + 1, dtype=torch.bool, device=self.device)
        keep[0] = False
        return self.timed(lambda: drop_rows(caches, keep, used), warmup, repeats) / len(caches)

    def time_kv_touch(self, b: int, slots: int, warmup: int, repeats: int) -> float:
        """Seconds per layer of a generation micro-batch's KV caches of ``b`` rows x ``slots`` positions as
        ``generation._MicroBatch`` makes them (``new_kv_caches(..., zeroed=0)``: uninitialized), each run on pages
        handed back to the operating system first (``release_free_memory``), plus the first touch of each page, which
        the prefill's and steps' cache writes pay (one element per page: the writes themselves are in the decode
        ops, timed on touched caches). A worker meets its caches on fresh pages: each request of a tiny generation
        of ``bench_fusion.py --setting fit`` took about 1700 minor page faults (its caches are 2176 pages). On one
        CPU thread (16 rows, 4 heads, 320 slots, 4 layers, load ~5): zero-filled 13-16 ms, uninitialized 0.04 ms,
        uninitialized then filled 14-20 ms: the faults moved from the allocation to the writes (``engine.kv_alloc``
        of older tables timed the zero-filled caches)."""
        stage = self.stack_model().stage
        held: list[object] = []

        def setup() -> None:
            held.clear()
            release_free_memory()

        def run() -> None:
            caches = stage.new_kv_caches(b, slots, zeroed=0)
            for c in caches:
                for x in (c.k, c.v):
                    x.view(-1)[::max(1, 4096 // x.element_size())] = 0  # one write per 4 KiB page
            held.append(caches)

        t = self.timed(run, warmup, repeats, setup)
        held.clear()
        return t / len(stage.layers)

    def time_schedule(self, b: int, warmup: int, repeats: int) -> dict[str, float]:
        """One decode step's draw (``generation._MicroBatch.sample``) of ``b`` rows with a length schedule (EOS
        banned, then placed where a row's scheduled length ends: ``length_schedule.force_lengths``) and without:
        the difference is what a scheduled generation (a seeded EOS schedule, issue 31 item 6) adds per step."""
        from realloc.lengths import ResponseLengths
        from realloc.models.generation import _MicroBatch
        from realloc.models.sampling import GenerationConfig

        vocab = self.cfg.vocab_size
        rows = [t for t in self._ids(b, 4).cpu()]
        g = torch.Generator().manual_seed(b)
        logits = torch.randn(b, vocab, generator=g).to(self.device)
        out = {}
        for name, sched in (("plain", None), ("scheduled", ResponseLengths.uniform(1, GEN_TOKENS[-1]))):
            cfg = GenerationConfig(max_new_tokens=GEN_TOKENS[-1], seed=1, eos_token_ids=(vocab - 1,),
                                   length_schedule=sched)
            mb = _MicroBatch(self.stack_model(), rows, list(range(b)), cfg)
            out[name] = self.timed(lambda: mb.sample(logits, 0), warmup, repeats)
        return out

    def time_ppo_train(self, b: int, gen_len: int, warmup: int, repeats: int) -> dict[str, float]:
        """PPO's actor train interface (``ppo_interfaces.actor_train``, one mini-batch) on ``b`` sequences of
        PPO_PROMPT_LEN + ``gen_len`` tokens, and the engine's train_step on the same sequences: the
        difference is the interface's own host work (KL-shaped rewards, GAE over the generated tokens,
        whitening, mini-batch assembly)."""
        from realloc.algorithms.context import CallContext
        from realloc.algorithms.ppo import ppo_interfaces as impl
        from realloc.algorithms.ppo.ppo_config import PPOConfig
        from realloc.calls import InterfaceType, ModelFunctionCallDef

        model = self.actor
        opt = model.make_optimizer(lr=1e-9)
        P, T = PPO_PROMPT_LEN, gen_len
        g = torch.Generator().manual_seed(b * 31 + T)
        tokens = torch.randint(0, self.cfg.vocab_size, (b, P + T), generator=g)

        def small() -> torch.Tensor:
            return torch.randn(b, T, generator=g) * 0.1

        inputs = {"seq": {"tokens": tokens, "prompt_lens": torch.full((b,), P, dtype=torch.long),
                          "gen_mask": torch.ones(b, T, dtype=torch.bool)},
                  "logp": {"logp": small()}, "ref_logp": {"logp": small()}, "values": {"values": small()},
                  "rewards": {"score": torch.randn(b, generator=g)}}
        call = ModelFunctionCallDef(name="actor_train", model_name="actor", model_type=self.cfg.name,
                                    interface_type=InterfaceType.TRAIN_STEP, interface_impl="ppo_actor",
                                    input_data=list(inputs), n_minibatches=1)
        ctx = CallContext(call=call, model=model, optimizer=opt, config=PPOConfig(n_minibatches=1), prompt_len=P,
                          gen_len=T, seed=1, iteration=0, ids=range(b), batch_size=b, n_mbs=1)
        batch = {"input_ids": tokens, "lengths": torch.full((b,), P + T, dtype=torch.long)}

        def loss_fn(out, mb):
            return out.logprobs().mean(), {}

        t_iface = self.timed(lambda: impl.actor_train(ctx, inputs), warmup, repeats)
        t_engine = self.timed(lambda: model.train_step([batch], loss_fn, opt, max_grad_norm=1.0), warmup, repeats)
        return {"interface": t_iface, "engine": t_engine}

    def time_optimizer(self, n_layers: int, warmup: int, repeats: int) -> tuple[int, float]:
        """(local parameters, seconds) of one optimizer update on a model of ``n_layers`` layers.

        Only the update of ``ParallelModel.make_optimizer()``: the gradient all-reduce is priced by
        the collective model, and the rest of the engine's post-backward work (grad norm,
        clipping) is part of the measured ``engine.train_step`` overhead.
        """
        from realloc.models.engine import ParallelModel

        cfg = self.cfg.with_layers(n_layers)
        model = ParallelModel(cfg, self.groups, device=self.device, dtype=self.dtype, seed=3)
        params = model.params()
        opt = model.make_optimizer(lr=1e-9)
        grads = {n: torch.full(p.shape, 1e-3, dtype=torch.float32, device=p.device) for n, p in params.items()}
        step_with = getattr(opt, "step_with", None)  # mixed precision: fp32 gradients go straight to the master

        def setup() -> None:
            if step_with is None:
                for n, p in params.items():
                    p.grad = grads[n].to(p.dtype)

        def run() -> None:
            if step_with is not None:
                step_with(grads)
            else:
                opt.step()

        t = self.timed(run, warmup, repeats, setup)
        for p in params.values():
            p.grad = None
        return sum(p.numel() for p in params.values()), t


# Ops whose cost does not depend on the second axis: the head of a prefill sees only the last
# position, and a decode step's embedding and heads see one token whatever the cache holds.
# They are measured on a one-column grid (s = 1), which lookups treat as flat along s.
FLAT_OPS = frozenset({(Part.HEAD, Phase.PREFILL), (Part.EMBED, Phase.DECODE), (Part.HEAD, Phase.DECODE),
                      (Part.CRITIC_HEAD, Phase.DECODE)})

PROFILED_OPS: tuple[tuple[Part, Phase], ...] = (
    *((part, phase) for part in (Part.EMBED, Part.BLOCK, Part.HEAD, Part.CRITIC_HEAD)
      for phase in (Phase.FWD, Phase.BWD)),
    (Part.EMBED, Phase.PREFILL), (Part.BLOCK, Phase.PREFILL), (Part.HEAD, Phase.PREFILL),
    (Part.EMBED, Phase.DECODE), (Part.BLOCK, Phase.DECODE), (Part.HEAD, Phase.DECODE), (Part.CRITIC_HEAD, Phase.DECODE),
)


def op_axes(part: Part, phase: Phase, grid: LayerGrid) -> tuple[int, ...]:
    """The second grid axis of an op: sequence lengths, cache lengths, or (1,) for a flat op."""
    if (part, phase) in FLAT_OPS:
        return (1,)
    return grid.ctx if phase is Phase.DECODE else grid.seq


# Engine overheads: the engine's own work around the layers (batch layouts, masks, micro-batch
# splitting, the train-step bookkeeping, the generation loop), measured as what a real
# ParallelModel call takes beyond the layer ops profiled above. Keys of TpTable.ops:
#   engine.fwd         per micro-batch of forward()            grid (b, s)
#   engine.train_mb    per micro-batch of train_step()         grid (b, s)
#   engine.train_step  once per train_step() (one optimizer step) grid (b, s)
#   engine.gen_call    once per generate() call                grid (b, prompt length)
#   engine.decode_step per generated token of generate()       grid (b, prompt length)
#   engine.row_drop    per layer, each time rows of a micro-batch finish while others run on (their KV caches
#                      copied, ``generation.drop_rows``)   grid (rows kept, cache positions)
#   engine.schedule_step per decode step of a generation with a length schedule (the seeded EOS schedule,
#                      ``length_schedule.py``): the ban and the forced EOS beyond a plain draw   grid (b, 1)
#   engine.kv_alloc    per layer, once per micro-batch of a generation: its KV caches of prompt + max_new_tokens
#                      positions allocated and zero-filled on fresh pages (older tables only, see below)
#                      grid (rows, cache positions)
#   engine.row_drop and engine.kv_alloc are the keys of tables from before the runtime compacted caches in place
#   and left them uninitialized (still priced, ``CallTimer.row_drops``/``kv_alloc``); the profiler now writes:
#   engine.row_drop_used  as engine.row_drop, moving only the written slots in place   grid (rows kept, slots used)
#   engine.kv_touch    per layer, a micro-batch's uninitialized caches plus the first touch of their pages
#                      (``LayerProfiler.time_kv_touch``)   grid (rows, slots touched)
ENGINE_KEYS = ("engine.fwd", "engine.train_mb", "engine.train_step", "engine.gen_call", "engine.decode_step",
               "engine.row_drop_used", "engine.schedule_step", "engine.kv_touch")
# generate() runs with these max_new_tokens to split per-call from per-token overhead (8 steps apart:
# the per-token residual is a difference of two noisy medians, divided by the steps between them)
GEN_TOKENS = (2, 10)
# Interface overheads: the host work of realloc's PPO interfaces beyond the engine calls they make,
# measured on the actor (``LayerProfiler.time_ppo_train``). Keys of TpTable.ops:
#   interface.train    once per PPO train call        grid (b, generated tokens), a line in the
#                                                      generated tokens (GAE steps), flat in b
# (PPO's inference and generation interfaces measured within noise of the engine calls they wrap.)
INTERFACE_KEYS = ("interface.train",)
INTERFACE_GEN_LENS = (8, 32, 128)
PPO_PROMPT_LEN = 8


def engine_plan(grid: LayerGrid, max_positions: int) -> Iterator[tuple[str, int, int]]:
    """Engine calls to time: forward and train_step over every other grid point (the overheads are
    fitted as a line, see ``profile_cli.engine_overheads``), generate() for prompts that leave room
    (every batch size), a length-scheduled draw (every batch size), the rows' cache copy when some finish
    (``row_drop_used``, every other batch size and cache length) and a micro-batch's caches allocated on fresh
    pages and first touched (``kv_touch``, the same points), and PPO's train interface (``ppo_train``, its second
    axis the generated tokens)."""
    for b in grid.batch:
        for s in grid.seq[::2]:
            if b in grid.batch[::2]:
                yield "forward", b, s
                yield "train", b, s
            # every batch size: a decode step's residual is small next to its ops
            if s + max(GEN_TOKENS) <= max_positions:
                yield "generate", b, s
        yield "schedule", b, 1
        for s in grid.ctx[::2] if b in grid.batch[::2] else ():
            yield "row_drop_used", b, s  # s: the cache's positions (a generation's prompt and new tokens)
            yield "kv_touch", b, s
        if b not in grid.batch[::2]:
            continue
        for t in INTERFACE_GEN_LENS:
            if PPO_PROMPT_LEN + t <= max_positions:
                yield "ppo_train", b, t


def op_plan(grid: LayerGrid) -> Iterator[tuple[Part, Phase, int, int]]:
    """Every (part, phase, batch, s) point the profiler measures, in order."""
    for part, phase in PROFILED_OPS:
        for b in grid.batch:
            for s in op_axes(part, phase, grid):
                yield part, phase, b, s


OPTIMIZER_LAYERS = (1, 2, 4)
