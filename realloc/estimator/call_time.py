"""Time of one function call from per-layer op costs (realhf.txt section 5.1, "time cost").

Inputs are per-device layer op costs (a measured profile table or the
roofline; both answer ``op(part, phase, tp, b, s) -> (compute, tp_comm)``),
the collective model and the call's workload. Terms:

- compute and TP collectives of every layer (2 all-reduces per block forward,
  2 more backward, 1 for the vocab-parallel embedding, the head's own);
- PP: stage-to-stage p2p of activations (forward) and their gradients (backward);
- the pipeline bubble of the schedules realloc runs (see ``pipeline_makespan``);
- DP: one ring all-reduce of the stage's gradients per optimizer step, fp32 or, with
  ``TrainConfig.grad_dtype="bf16"``, bf16 (``Precision.grad`` bytes per element; with
  packing them into flat buckets and back), plus the scalar all-reduce of the
  gradient-norm clip over the whole layout and the one of the loss statistics;
- KV heads replicated over tp ranks (tp > KV heads): one all-reduce per optimizer step
  of the stage's k/v gradients among the tp / n_kv_heads ranks sharing a head (counted
  as tp communication);
- PPO's train interface: its measured host work per call (rollout, GAE) and the
  dp all-reduce of its advantage moments;
- activation recomputation: one more forward of every block (with its tp
  all-reduces) per training micro-batch;
- the Adam step, memory-bound over parameters and states;
- generation = prefill of the prompt, then gen_len - 1 decode steps whose KV
  cache grows from prompt_len + 1 to prompt_len + gen_len - 1 positions; with
  pp > 1 the micro-batches are pipelined through the stages (``decode_round``), at most
  pp at a time (waves of pp micro-batches);
- host overheads from the hardware spec: one dispatch per call, and per decode
  step per micro-batch and stage the sampling bookkeeping;
- response lengths (``realloc.lengths``, issue 31): with lengths that vary, a micro-batch's rows finish
  at the expected order statistics of the distribution and decode steps run only the rows still going
  (``generate_varied``); inference and training run a micro-batch's packed rows, as wide as its expected
  longest sequence and as many as its expected tokens fill (``Workload.packed``). Fixed lengths (the
  default) price exactly the formulas above.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol, Sequence

from realloc.calls import InterfaceType
from realloc.estimator.comm import CommModel, GroupLinks
from realloc.estimator.hardware import HardwareSpec, Precision
from realloc.estimator.kept_prefill import with_kept_keys
from realloc.estimator.memory import Workload, max_local_params
from realloc.estimator.opcount import Part, Phase, head_part
from realloc.models.config import ModelConfig
from realloc.models.param_layout import replicated_shard_numel, stage_layer_ranges, trained_shard_numel
from realloc.strategy import ParallelStrategy


class LayerCosts(Protocol):
    source: str

    def op(self, part: Part, phase: Phase, tp: int, b: int, s: int) -> tuple[float, float]:
        """(local compute, tp collectives) seconds of one op on one device."""

    def optimizer(self, n_params: int) -> float:
        """Seconds of one optimizer step over ``n_params`` local parameters."""

    def engine(self, key: str, tp: int, b: int, s: int) -> float | None:
        """Measured engine overhead ``key`` (``profiler.ENGINE_KEYS``), or None where nothing was measured."""

    def interface(self, key: str, tp: int, gen_len: int) -> float | None:
        """Measured interface overhead ``key`` (``profiler.INTERFACE_KEYS``), or None where nothing was measured."""


@dataclasses.dataclass(frozen=True)
class CallCost:
    """Seconds one call takes, and where they go.

    ``compute``, ``tp_comm`` and ``pp_comm`` are the busy time of the most loaded
    pipeline stage; ``bubble`` is the rest of the pipeline's makespan, so
    ``time`` is exactly the sum of the parts.
    """

    time: float
    compute: float = 0.0
    tp_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    dp_allreduce: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0

    @classmethod
    def of(cls, **parts: float) -> "CallCost":
        return cls(time=sum(parts.values()), **parts)

    def scaled(self, k: float) -> "CallCost":
        return CallCost(**{f.name: getattr(self, f.name) * k for f in dataclasses.fields(self)})

    def __add__(self, other: "CallCost") -> "CallCost":
        return CallCost(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def breakdown(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "time"}


ZERO = CallCost(0.0)

# Loss statistics a train step averages over dp (ParallelModel._mean_stats: loss and the loss
# function's stats; PPO reports none beyond the loss through the engine).
TRAIN_STATS = 1

# Elements per coalesced gradient all-reduce (realloc.models.grads.BUCKET_NUMEL; not imported,
# that module needs torch; tests/test_estimator_cost.py checks they agree).
GRAD_BUCKET_NUMEL = 1 << 25


def train_step_dp_syncs(n_buckets: int) -> int:
    """Blocking dp collectives of one train step at dp > 1: a reduce-scatter and an all-gather per gradient bucket
    (``models/zero.py``), the gradient norm's all-reduce (``grads.global_norm``) and the loss statistics'
    (``ParallelModel._mean_stats``); tests/test_est_fit.py counts them in a real step."""
    return 2 * n_buckets + 2


@dataclasses.dataclass(frozen=True)
class StageTime:
    """One micro-batch on one pipeline stage."""

    compute: float
    tp_comm: float
    pp_comm: float
    host: float = 0.0  # the engine's own work around the layers (measured engine overheads)

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.host


def _busy(worst: StageTime, n_mbs: int) -> CallCost:
    return CallCost.of(compute=n_mbs * worst.compute, tp_comm=n_mbs * worst.tp_comm, pp_comm=n_mbs * worst.pp_comm,
                       overhead=n_mbs * worst.host)


def pipeline_makespan(stages: Sequence[StageTime], n_mbs: int) -> CallCost:
    """Makespan of ``n_mbs`` micro-batches through pipeline stages with per-micro-batch times ``stages``.

    For a forward-only pass, and for 1F1B training with a stage's time being its
    forward plus backward of one micro-batch, the last micro-batch leaves the
    last stage (or the first stage's backward ends) after
        sum_k t_k + (n_mbs - 1) * max_k t_k.
    The first micro-batch needs every stage once; each further one is paced by
    the slowest stage. With equal stages that is (n_mbs + pp - 1) t, i.e. a
    bubble of (pp - 1) / n_mbs relative to the n_mbs * t of useful work.
    """
    worst = max(stages, key=lambda st: st.total)
    busy = _busy(worst, n_mbs)
    span = sum(st.total for st in stages) + (n_mbs - 1) * worst.total
    return dataclasses.replace(busy, time=span, bubble=span - busy.time)


def decode_round(stages: Sequence[StageTime], n_mbs: int, back: float) -> CallCost:
    """One decode step of ``n_mbs`` micro-batches pipelined through the stages (``models/generation.py``).

    A micro-batch's next step starts on the first stage only once its tokens came back from the
    last stage (``back`` seconds after they were sampled), so a round lasts the longer of the
    busiest stage's ``n_mbs`` steps and one micro-batch's trip through every stage and back:
        max(n_mbs * max_k t_k, sum_k t_k + back).
    With pp = 1 that is n_mbs * t: micro-batches one after another.
    """
    worst = max(stages, key=lambda st: st.total)
    busy = _busy(worst, n_mbs)
    span = max(n_mbs * worst.total, sum(st.total for st in stages) + back)
    return dataclasses.replace(busy, time=span, bubble=span - busy.time)


def sum_over_range(f: Callable[[int], CallCost], lo: int, hi: int, extra_points: Sequence[int] = ()) -> CallCost:
    """sum_{x=lo}^{hi} f(x), exact when f is linear between the sampled points.

    Samples lo, hi, ``extra_points`` inside (the profile grid, where a measured
    table bends) and 16 evenly spaced points; sums each linear piece as an
    arithmetic series.
    """
    if hi < lo:
        return ZERO
    pts = {lo, hi, *(p for p in extra_points if lo < p < hi)}
    pts.update(lo + (hi - lo) * i // 16 for i in range(17))
    xs = sorted(pts)
    vals = [f(x) for x in xs]
    total = vals[0]
    for (x0, v0), (x1, v1) in zip(zip(xs, vals), zip(xs[1:], vals[1:])):
        # points x0+1 .. x1 of the line through (x0, v0) and (x1, v1)
        total = total + _series(v0, v1, x1 - x0)
    return total


def _series(v0: CallCost, v1: CallCost, n: int) -> CallCost:
    """Sum of a line's values at x0+1 .. x0+n, where it is v0 at x0 and v1 at x0+n."""
    # sum_{i=1}^{n} (v0 + (v1 - v0) i / n) = n v0 + (v1 - v0)(n + 1)/2
    return v0.scaled(n) + (v1 + v0.scaled(-1)).scaled((n + 1) / 2)


# Decode segments (runs of steps with one row count) priced one by one; more are merged (decode_segments).
MAX_DECODE_SEGMENTS = 16


def decode_segments(ends: Sequence[int], max_segments: int = MAX_DECODE_SEGMENTS) -> list[tuple[int, int, int]]:
    """(first step, last step, rows running) of a micro-batch's decode steps 1 .. max(ends) - 1, where row i stops
    after ``ends[i]`` tokens (ascending): step j runs the rows with ends > j.

    Beyond ``max_segments`` runs, consecutive runs merge into ``max_segments`` groups, each priced at its mean
    row count (rounded), so that the rows x steps it decodes stay the same up to rounding: a decode step's
    cost is nearly affine in its rows, and a micro-batch of hundreds of rows would otherwise price hundreds of
    runs."""
    b = len(ends)
    runs, first = [], 1
    for i, end in enumerate(ends):
        if end - 1 >= first:
            runs.append((first, end - 1, b - i))
            first = end
    if len(runs) <= max_segments:
        return runs
    out = []
    for k in range(max_segments):
        group = runs[k * len(runs) // max_segments:(k + 1) * len(runs) // max_segments]
        steps = sum(hi - lo + 1 for lo, hi, _ in group)
        row_steps = sum((hi - lo + 1) * r for lo, hi, r in group)
        out.append((group[0][0], group[-1][1], max(1, math.floor(row_steps / steps + 0.5))))
    return out


class CallTimer:
    """Time of calls of one model on one layout; all inputs explicit, nothing cached."""

    def __init__(self, cfg: ModelConfig, costs: LayerCosts, comm: CommModel, hw: HardwareSpec,
                 decode_grid: Sequence[int] = (), precision: Precision | None = None) -> None:
        self.cfg, self.costs, self.comm, self.hw = cfg, costs, comm, hw
        # the train call's precision (bf16 gradient buffers halve the dp traffic), else the hardware's
        self.precision = precision or hw.precision
        self.decode_grid = tuple(decode_grid)
        # op costs shared by every layout with the same (tp, micro-batch): meshes, pp and dp differ
        self._ops: dict[tuple[Part, Phase, int, int, int], tuple[float, float]] = {}

    def op(self, part: Part, phase: Phase, tp: int, b: int, s: int) -> tuple[float, float]:
        key = (part, phase, tp, b, s)
        v = self._ops.get(key)
        if v is None:
            v = self._ops[key] = self.costs.op(part, phase, tp, b, s)
        return v

    def _stages(self, phase: Phase, strategy: ParallelStrategy, links: GroupLinks, b: int, s: int,
                backward: bool = False, host: float = 0.0, recompute: bool = False) -> list[StageTime]:
        cfg, t, pp = self.cfg, strategy.tp, strategy.pp
        op = self.op
        phases = (phase, Phase.BWD) if backward else (phase,)
        # recomputation runs every block's forward once more before its backward (embedding and head
        # are not recomputed); the profiled BWD is (forward with autograd + backward) - FWD
        block = [op(Part.BLOCK, ph, t, b, s) for ph in phases + ((Phase.FWD,) if recompute else ())]
        embed = [op(Part.EMBED, ph, t, b, s) for ph in phases]
        head = [op(head_part(cfg), ph, t, b, s) for ph in phases]
        n_tok = b if phase is Phase.DECODE else b * s
        act_bytes = n_tok * cfg.hidden_size * self.precision.param
        if phase in (Phase.FWD, Phase.BWD):
            act_bytes /= t  # sequence parallel: a stage sends its rank's n/t tokens (models/sequence_parallel.py)
        out = []
        for k, (lo, hi) in enumerate(stage_layer_ranges(cfg.n_layers, pp)):
            parts = [(c * (hi - lo), x * (hi - lo)) for c, x in block]
            if k == 0:
                parts += embed
            if k == pp - 1:
                parts += head
            p2p = 0.0
            # forward activations to the next stage; gradients back to the previous one
            if k < pp - 1:
                p2p += self.comm.time("p2p", 2, act_bytes, links.pp[k])
            if backward and k > 0:
                p2p += self.comm.time("p2p", 2, act_bytes, links.pp[k - 1])
            if phase in (Phase.PREFILL, Phase.DECODE) and k == pp - 1:
                # the last stage sends the sampled tokens and their log-probs (2 x b float64) to every
                # other stage (generation.py)
                p2p += (pp - 1) * self.comm.time("p2p", 2, 16 * b, links.pp_any)
            out.append(StageTime(compute=sum(c for c, _ in parts), tp_comm=sum(x for _, x in parts), pp_comm=p2p,
                                 host=host))
        return out

    def _engine(self, key: str, tp: int, b: int, s: int, default: float = 0.0) -> float:
        v = self.costs.engine(key, tp, b, s)
        return default if v is None else v

    def time(self, work: Workload, strategy: ParallelStrategy, links: GroupLinks, n_mbs: int,
             recompute: bool = False) -> CallCost:
        b, t = work.micro_batch(strategy.dp, n_mbs), strategy.tp
        seq, prompt = work.seq_len, work.prompt_len
        overhead = CallCost.of(overhead=self.hw.call_overhead)
        if work.interface is not InterfaceType.GENERATE:
            # the packed rows of a micro-batch: with varying lengths, fewer rows than sequences (issue 31)
            b, seq = work.packed(b, strategy.dp)  # at dp > 1 the slowest rank's (packed_rows.py)
        if work.interface is InterfaceType.INFERENCE:
            host = self._engine("engine.fwd", t, b, seq)
            return pipeline_makespan(self._stages(Phase.FWD, strategy, links, b, seq, host=host), n_mbs) + overhead
        if work.interface is InterfaceType.TRAIN_STEP:
            step = self.train_step(strategy, links, b, seq, n_mbs, recompute)
            # PPO's interface (realloc.algorithms.ppo.ppo_interfaces): the rollout (GAE over the generated
            # tokens, whitening) once per call, and the dp all-reduce of its advantage moments and
            # mini-batch token counts (3 + n_steps float64s)
            iface = self.costs.interface("interface.train", t, work.gen_len) or 0.0
            moments = self.comm.time("all_reduce", strategy.dp, 8 * (3 + work.n_steps), links.dp)
            moments += self.comm.late_extra(strategy.dp, links.dp)  # entered late too, after each rank's rollout
            return step.scaled(work.n_steps) + overhead + CallCost.of(overhead=iface, dp_allreduce=moments)
        ends = work.lengths.slowest_ends(work.gen_len, b, work.n_seqs)  # all gen_len for fixed lengths
        return self.generate_varied(strategy, links, b, prompt, ends, n_mbs, slots=prompt + work.gen_len,
                                    scheduled=work.scheduled) + overhead

    def train_step(self, strategy: ParallelStrategy, links: GroupLinks, b: int, seq: int, n_mbs: int,
                   recompute: bool = False) -> CallCost:
        """One ``ParallelModel.train_step``: 1F1B over ``n_mbs`` micro-batches of ``b`` sequences of ``seq``
        tokens, then the gradient all-reduce, clipping and the optimizer update."""
        t = strategy.tp
        host = self._engine("engine.train_mb", t, b, seq)
        stages = self._stages(Phase.FWD, strategy, links, b, seq, backward=True, host=host, recompute=recompute)
        return pipeline_makespan(stages, n_mbs) + self._optimizer_step(strategy, links) + CallCost.of(
            overhead=self._engine("engine.train_step", t, b, seq) * self._param_ratio(strategy))

    def train_stage_passes(self, strategy: ParallelStrategy, links: GroupLinks, b: int, seq: int,
                           recompute: bool = False) -> tuple[list[float], list[float]]:
        """Per pipeline stage, seconds of one micro-batch's forward and of its backward in a train step (the
        backward: ``train_step``'s stage time less the forward; recomputation and the engine's per-micro-batch
        host work count there). The fused schedule (estimator/fused_cost.py) orders these passes."""
        host = self._engine("engine.train_mb", strategy.tp, b, seq)
        both = self._stages(Phase.FWD, strategy, links, b, seq, backward=True, host=host, recompute=recompute)
        fwd = [st.total for st in self._stages(Phase.FWD, strategy, links, b, seq)]
        return fwd, [st.total - f for st, f in zip(both, fwd)]

    def generate(self, strategy: ParallelStrategy, links: GroupLinks, b: int, prompt: int, gen_len: int,
                 n_mbs: int) -> CallCost:
        """One ``ParallelModel.generate`` of ``n_mbs`` micro-batches of ``b`` prompts (realloc.models.generation).

        Every micro-batch runs a prefill, which samples the first token, and gen_len - 1 decode steps
        whose KV cache grows from prompt + 1 positions. With pp > 1 the micro-batches are pipelined
        (prefill like a forward, decode steps as ``decode_round``), at most pp at a time, so more than pp
        go in waves; with pp = 1 both formulas are n_mbs micro-batches one after another. A step's bookkeeping (recording tokens, pruning
        finished rows, the next step's mask; sampling is in the head op) runs on every stage for
        every micro-batch, and the sampled tokens travel from the last stage back to the others.
        """
        return self.generate_varied(strategy, links, b, prompt, (gen_len,) * b, n_mbs)

    def generate_varied(self, strategy: ParallelStrategy, links: GroupLinks, b: int, prompt: int,
                        ends: Sequence[int], n_mbs: int, prefill: int | None = None, slots: int | None = None,
                        scheduled: bool = False) -> CallCost:
        """``generate`` when responses differ in length (issue 31): row i of a micro-batch stops after
        ``ends[i]`` tokens (ascending: the expected order statistics, ``ResponseLengths.order_statistics``).

        Finished rows leave the micro-batch (``models/generation.py``), so decode step j (its KV cache at
        prompt + j positions) runs the rows with ends > j, and the micro-batch ends with its longest row. Runs
        of steps with one row count are summed with ``sum_over_range``.

        ``prefill``: the tokens the prefill runs when the rows' earlier keys and values are kept (a multi-turn
        rollout's later turns, ``models/turn_cache.py``); the decode steps still attend to all ``prompt``.
        The prefill is priced at those tokens, plus their attention over the ``prompt - prefill`` kept keys
        (``kept_prefill.py``).

        Measured host work beyond the steps (``row_step_extras``): each time rows finish while others run on, their
        KV caches of ``slots`` positions (the prompt and the call's new tokens; default prompt + max(ends)) are
        copied; with ``scheduled`` (a seeded length schedule) every step's draw also bans and places EOS; and each
        micro-batch first allocates those caches on fresh pages (``kv_alloc``).
        """
        if strategy.pp > 1 and n_mbs > strategy.pp:
            # At most pp micro-batches hold a KV cache at once: with equal lengths they go in waves of pp, each
            # filling and draining the pipeline (models/generation.py); priced so for any lengths.
            full, rest = divmod(n_mbs, strategy.pp)
            wave = self.generate_varied(strategy, links, b, prompt, ends, strategy.pp, prefill, slots,
                                        scheduled).scaled(full)
            return wave + self.generate_varied(strategy, links, b, prompt, ends, rest, prefill, slots,
                                               scheduled) if rest else wave
        t = strategy.tp
        host = self._engine("engine.decode_step", t, b, prompt, default=self.hw.decode_step_overhead)
        host += self._schedule(t, b, scheduled)
        new = prompt if prefill is None else prefill
        stages = self._stages(Phase.PREFILL, strategy, links, b, new, host=host)
        if new < prompt:  # the prefill's attention over the kept keys (estimator/kept_prefill.py)
            stages = with_kept_keys(self, stages, t, b, new, prompt - new)
        total = pipeline_makespan(stages, n_mbs)
        total = total + CallCost.of(overhead=n_mbs * (self._engine("engine.gen_call", t, b, prompt)
                                                      + self.row_drops(strategy, ends, slots or prompt + max(ends),
                                                                       prompt)
                                                      + self.kv_alloc(strategy, b, slots or prompt + max(ends),
                                                                      prompt + sum(ends) / len(ends) - 1)))
        for first, last, rows in decode_segments(ends):
            r_host = self._engine("engine.decode_step", t, rows, prompt, default=self.hw.decode_step_overhead)
            r_host += self._schedule(t, rows, scheduled)
            back = self.comm.time("p2p", 2, 16 * rows, links.pp_any) if strategy.pp > 1 else 0.0

            def step(ctx: int, rows: int = rows, r_host: float = r_host, back: float = back) -> CallCost:
                stages = self._stages(Phase.DECODE, strategy, links, rows, ctx, host=r_host)
                return decode_round(stages, n_mbs, back)

            total = total + sum_over_range(step, prompt + first, prompt + last, self.decode_grid)
        return total

    def _schedule(self, tp: int, rows: int, scheduled: bool) -> float:
        """A step's extra draw work under a length schedule (measured ``engine.schedule_step``; 0 without)."""
        return self._engine("engine.schedule_step", tp, rows, 1) if scheduled else 0.0

    def row_drops(self, strategy: ParallelStrategy, ends: Sequence[int], slots: int,
                  prompt: int | None = None) -> float:
        """Seconds one micro-batch spends dropping finished rows (``models/generation.drop_rows``): at every
        length in ``ends`` but the longest, the rows still running move their caches, one per layer of the stage
        holding the most. With ``engine.row_drop_used`` measured and ``prompt`` given, the rows that stop after e
        tokens finish at step e - 1, when slots [0, prompt + e - 1) are written and only those move (the in-place
        compaction); a table with only ``engine.row_drop`` (the older whole-cache copy) prices every finish at
        all ``slots``, as before."""
        used = prompt is not None and self.costs.engine("engine.row_drop_used", strategy.tp, 1, slots) is not None
        key = "engine.row_drop_used" if used else "engine.row_drop"
        if not ends or self.costs.engine(key, strategy.tp, 1, slots) is None:
            return 0.0  # not measured (a roofline, or a profile from before the key)
        layers = max(hi - lo for lo, hi in stage_layer_ranges(self.cfg.n_layers, strategy.pp))
        order = sorted(ends)
        total = 0.0
        for i, e in enumerate(order[:-1]):
            if order[i + 1] > e:  # the last row of length e: the rows after it run on
                total += self._engine(key, strategy.tp, len(order) - i - 1, prompt + e - 1 if used else slots)
        return layers * total

    def kv_alloc(self, strategy: ParallelStrategy, b: int, slots: int, touched: float | None = None) -> float:
        """Seconds a micro-batch of ``b`` rows spends allocating its KV caches of ``slots`` positions on fresh pages
        (``llama.new_kv_caches``), one pair per layer of the stage holding the most; 0 for a roofline or a profile
        from before the keys.

        ``engine.kv_touch`` (measured, per layer, a line in rows x slots): the caches come uninitialized and the
        prefill's and steps' writes fault their pages in. A row of length e writes slots [0, prompt + e - 1) and
        compaction (``drop_rows``) keeps the running rows at the front, so buffer row r is written as far as the
        (r + 1)-th longest row: ``touched``, the slots a buffer row touches on average, is prompt + mean(ends) - 1
        (the runtime's count: tests/test_est_follow.py). Without that key, ``engine.kv_alloc`` (the older zero-filled
        caches) at all ``slots``, as before."""
        per_layer = None if touched is None else self.costs.engine("engine.kv_touch", strategy.tp, b, touched)
        if per_layer is None:
            per_layer = self.costs.engine("engine.kv_alloc", strategy.tp, b, slots)
        if per_layer is None:
            return 0.0
        return max(hi - lo for lo, hi in stage_layer_ranges(self.cfg.n_layers, strategy.pp)) * per_layer

    def _param_ratio(self, strategy: ParallelStrategy) -> float:
        """Local parameters of the stage holding the most, over those of the one-layer model the
        profiler measured the train step's overhead on: that overhead (gradient norm, clipping,
        zeroing) is passes over every parameter."""
        one = self.cfg.with_layers(1, is_critic=False, tie_embeddings=False, lora=None)
        # LoRA: those passes cover only the trained adapters
        trained = max(trained_shard_numel(self.cfg, strategy.tp, strategy.pp, k) for k in range(strategy.pp))
        return trained / max_local_params(one, strategy.tp, 1)

    def _optimizer_step(self, strategy: ParallelStrategy, links: GroupLinks) -> CallCost:
        """After the last backward (``realloc.models.grads``): the sum of replicated KV heads'
        gradients, the grad-norm's scalar all-reduces over tp and pp, clipping and AdamW, all on the stage
        holding the most parameters. With dp 1 AdamW steps every local parameter. With dp > 1 the distributed
        optimizer (``realloc.models.zero``) reduce-scatters the gradients (fp32 or bf16) and all-gathers the updated
        parameters in buckets of GRAD_BUCKET_NUMEL elements, and AdamW steps a 1/dp chunk."""
        # what the optimizer steps and dp reduces: every parameter, or with LoRA the adapters
        n_local = max(trained_shard_numel(self.cfg, strategy.tp, strategy.pp, k) for k in range(strategy.pp))
        dp = 0.0
        n_step = n_local
        if strategy.dp > 1:
            n_step = -(-n_local // strategy.dp)
            n_buckets = -(-n_local // GRAD_BUCKET_NUMEL)
            chunk = n_local / n_buckets / strategy.dp
            # A ring reduce-scatter moves what a ring all-gather of its output chunk moves, (dp - 1) chunks per
            # rank; the measured all-gather fit prices both (the reduction's arithmetic is memory-bound and
            # counted with the packing below).
            dp = n_buckets * (self.comm.time("all_gather", strategy.dp, chunk * self.precision.grad, links.dp)
                              + self.comm.time("all_gather", strategy.dp, chunk * self.precision.param, links.dp))
            # each bucket is packed into one flat buffer and unpacked after, for both collectives (zero.py)
            moved = 2 * n_local * (self.precision.grad + self.precision.param)
            dp += moved / (self.hw.memory_bandwidth * self.hw.memory_efficiency)
            # each of the step's blocking dp collectives waits as one entered late (comm.late_extra; 0 unmeasured)
            dp += train_step_dp_syncs(n_buckets) * self.comm.late_extra(strategy.dp, links.dp)
        norm = (self.comm.time("all_reduce", strategy.tp, 8, links.tp)
                + self.comm.time("all_reduce", strategy.pp, 8, links.pp_any)
                + self.comm.time("all_reduce", strategy.dp, 8, links.dp))  # over dp: the norm of the chunks
        # the last stage averages the loss statistics over dp replicas (a few float64s)
        stats = self.comm.time("all_reduce", strategy.dp, 8 * TRAIN_STATS, links.dp)
        return CallCost.of(tp_comm=self._kv_replica_sync(strategy, links), dp_allreduce=dp + norm + stats,
                           optimizer=self.costs.optimizer(n_step))

    def _kv_replica_sync(self, strategy: ParallelStrategy, links: GroupLinks) -> float:
        """``grads.sync_kv_replicas``: one coalesced all-reduce of the stage's k/v gradients among the
        tp ranks sharing a KV head (0 unless tp exceeds the KV heads); the slowest stage's."""
        group = self.cfg.kv_replicas(strategy.tp)
        if group == 1:
            return 0.0
        numel = max(replicated_shard_numel(self.cfg, strategy.tp, strategy.pp, k) for k in range(strategy.pp))
        return self.comm.time("all_reduce", group, numel * self.precision.grad, links.tp)
