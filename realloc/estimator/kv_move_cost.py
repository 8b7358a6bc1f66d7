"""Pricing a long-tail migration that moves the tail's KV caches instead of re-running its prefill (issue 31 item 3;
``TailMigration.kv``; runtime: models/kv_move.py, runtime/control/tail_kv.py).

A tail replica holding ``per`` = ceil(R_t / m) rows at migration step ``cut`` gets, on average, (dp - 1) / dp of
them from the other dp replicas (the rows are dealt over the replicas before the migration point: its own share
stays). Each row moves its written slots, prompt + cut of them, every layer of the stage, K and V of the rank's
local KV heads in the cache dtype (at tp > 1 each tp rank moves its own heads over its dp group, in parallel). The
senders' messages meet at the tail replica's link: one p2p of all their bytes. Around it:
- a sender packs its rows (one copy of their written slots, as ``drop_rows`` copies a row's used slots:
  ``engine.row_drop_used``, per layer), ceil(per / dp) rows;
- the tail replica allocates its caches (``CallTimer.kv_alloc``, as the re-run prefill does) and copies all
  ``per`` rows' slots into them (``engine.row_drop_used`` again).
No prefill runs. The rows' all-gather carries three more columns per row (``MOVE_ROW_BYTES``).
"""

from __future__ import annotations

from realloc.estimator.call_time import CallTimer
from realloc.estimator.comm import CommModel, Link
from realloc.estimator.hardware import Precision
from realloc.estimator.opcount import kv_cache_bytes_per_token_layer
from realloc.models.config import ModelConfig
from realloc.models.param_layout import stage_layer_ranges
from realloc.strategy import ParallelStrategy

# the move's columns of a row in the all-gather (worker_tail._moving_columns): source replica and its
# micro-batch's width (int64), finished ahead (one byte)
MOVE_ROW_BYTES = 8 + 8 + 1


def stage_layers(cfg: ModelConfig, pp: int) -> int:
    return max(hi - lo for lo, hi in stage_layer_ranges(cfg.n_layers, pp))


def row_kv_bytes(cfg: ModelConfig, strategy: ParallelStrategy, precision: Precision, slots: int) -> float:
    """Bytes of one row's ``slots`` written cache slots on one rank (all layers of its stage, K and V)."""
    return stage_layers(cfg, strategy.pp) * kv_cache_bytes_per_token_layer(cfg, strategy.tp, precision) * slots


def kv_move_seconds(timer: CallTimer, comm: CommModel, link: Link, cfg: ModelConfig, strategy: ParallelStrategy,
                    precision: Precision, per: int, prompt: int, cut: int, slots: int, touched: float) -> float:
    """Seconds from the rows' all-gather until a tail replica of ``per`` rows can decode step cut + 1: the senders'
    packing, the caches' transfer and their assembly (the module's docstring)."""
    dp = strategy.dp
    written = prompt + cut
    received = per * (dp - 1) / dp
    transfer = comm.time("p2p", 2, received * row_kv_bytes(cfg, strategy, precision, written), link)
    layers = stage_layers(cfg, strategy.pp)

    def copy(rows: int) -> float:
        return layers * timer._engine("engine.row_drop_used", strategy.tp, rows, written)

    return copy(-(-per // dp)) + transfer + timer.kv_alloc(strategy, per, slots, touched) + copy(per)
