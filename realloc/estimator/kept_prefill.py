"""A prefill after kept keys: the attention of a multi-turn rollout's later turn over its kept KV cache (issue 34).

With the KV cache kept across turns (``models/turn_cache.py``), turn k > 1 prefills only what was appended, ``s``
new tokens per row (the last sampled token and the observation), after ``kept`` positions whose keys and values
the cache holds. Its GEMMs, norms and head run on the ``s`` new tokens, as a prefill of ``s`` tokens does; its
attention reads every kept key as well: each new token attends ``kept`` more positions than in a prefill of
``s`` tokens alone (``opcount.kept_prefill_block_work``).

The extra seconds per block are the roofline's attention over the kept keys, scaled by how the layer costs grow
against the roofline between a prefill of ``s`` tokens and one of ``s + kept``:

    extra = k x (R_kept(b, s, kept) - R(b, s)),   k = max(0, M(b, s + kept) - M(b, s)) / (R(b, s + kept) - R(b, s))

with R the roofline's block prefill (``R_kept`` with the kept keys) and M the costs the estimator prices with (a
measured profile table, or the roofline itself, where k = 1 and the price is the roofline's prefill with the kept
keys exactly). This is how ``profile_table`` extrapolates beyond its grid: the measured slope over the
roofline's, so that the profile's fixed per-op costs (launches) are not counted again and a table whose
prefill does not grow with length prices no extra. The tp collectives do not depend on the kept keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from realloc.estimator.opcount import Part, Phase, kept_prefill_block_work
from realloc.estimator.roofline import RooflineCosts, work_time
from realloc.models.param_layout import stage_layer_ranges


def kept_attention_s(timer: Any, tp: int, b: int, s: int, kept: int) -> float:
    """Seconds one block's prefill of ``b`` rows of ``s`` new tokens spends beyond a plain prefill of ``s`` tokens,
    attending ``kept`` kept positions (the module docstring's formula). ``timer`` is a ``call_time.CallTimer``
    (typed loosely: call_time imports this module)."""
    if kept <= 0:
        return 0.0
    costs = timer.costs
    roof = costs if isinstance(costs, RooflineCosts) else getattr(costs, "roofline", None)
    if roof is None:
        roof = RooflineCosts(timer.cfg, timer.hw, timer.comm)
    r_new = roof.op(Part.BLOCK, Phase.PREFILL, tp, b, s)[0]
    r_all = roof.op(Part.BLOCK, Phase.PREFILL, tp, b, s + kept)[0]
    if r_all <= r_new:
        return 0.0
    m_new = timer.op(Part.BLOCK, Phase.PREFILL, tp, b, s)[0]
    m_all = timer.op(Part.BLOCK, Phase.PREFILL, tp, b, s + kept)[0]
    k = max(0.0, m_all - m_new) / (r_all - r_new)
    r_kept = work_time(kept_prefill_block_work(timer.cfg, tp, b, s, kept, roof.precision), timer.hw, False)
    return k * max(0.0, r_kept - r_new)


def with_kept_keys(timer: Any, stages: Sequence[Any], tp: int, b: int, s: int, kept: int) -> list[Any]:
    """Prefill stages of ``s`` new tokens with the attention over ``kept`` kept positions added to each stage's
    compute, once per block the stage holds."""
    extra = kept_attention_s(timer, tp, b, s, kept)
    ranges = stage_layer_ranges(timer.cfg.n_layers, len(stages))
    return [dataclasses.replace(st, compute=st.compute + extra * (hi - lo)) for st, (lo, hi) in zip(stages, ranges)]
