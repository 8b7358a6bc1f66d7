"""The master's side of a fused train pair (plan field 'fused', docs/fused-training.md): one request.

``FusedPairs`` is one part of ``Master`` (``master.py``), next to ``IterationSchedule``
(``master_schedule.py``), whose ``_deps`` and ``_call`` hand fused calls to it. The pair's first call
sends one ``RunCall`` (``fused_with`` the second) to the mesh's workers once both calls' dependencies are
met, with both calls' inputs pushed before it and the schedule's order of passes per stage group; its
reply carries both calls' stats (``worker_fused.py``). The second call's node waits for the first's and
does nothing itself, so whatever waits for either call waits for the fused request. The iteration's times
book each call its estimated share of the request's time (``_booked``).

The order comes from the estimator (``estimator/fused_cost.price_fused_pair``: the schedule search on the
estimator's per-stage pass times), computed once per run, here, so every worker runs the same one.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

from realloc.runtime.control.master_link import RunFailed
from realloc.runtime.wire import protocol

log = logging.getLogger("realloc.master")


def fused_orders(graph: Any, plan: Any) -> dict[tuple[str, str], list[list[list[int]]]]:
    """Per fused pair of ``plan``: each stage group's passes, as the estimator's schedule search orders them."""
    if not plan.fused:
        return {}
    from realloc.estimator.cost import CostModel
    from realloc.estimator.fused_cost import price_fused_pair

    cost = CostModel(graph)
    out = {}
    for first, second in plan.fused:
        priced = price_fused_pair(cost, plan, first, second)
        out[first, second] = [[list(p) for p in stage] for stage in priced.schedule.order]
        log.info("fused %s + %s: %.3f s estimated for both calls (%.3f s one after the other)", first, second,
                 priced.time, priced.serial_time)
    return out


def fused_shares(graph: Any, plan: Any) -> dict[tuple[str, str], float]:
    """Per fused pair of ``plan``: the first call's share of the pair's time, its estimated time alone over both
    calls' (the pair runs as one request; metrics book each call its share of it)."""
    from realloc.estimator.cost import CostModel

    cost = CostModel(graph)
    out = {}
    for first, second in plan.fused:
        pair = (first, second)
        times = [cost.call_cost(c, cost.cluster.mesh(p.mesh), p.strategy, p.n_mbs, p.recompute).time
                 for c, p in ((c, plan.placements[c]) for c in pair)]
        out[pair] = times[0] / sum(times) if sum(times) > 0 else 0.5
    return out


class FusedPairs:
    """The fused pairs' nodes and requests (a part of ``Master``)."""

    @cached_property
    def _fused_shares(self) -> dict[tuple[str, str], float]:
        return fused_shares(self.graph, self.program.plan)

    def _booked(self, n: Any, seconds: float) -> list[tuple[str, float]]:
        """Where node ``n``'s ``seconds`` go in the iteration's times: a fused pair's first call ran both
        calls' request, so each call gets its share (``fused_shares``); any other node keeps its own."""
        key = n.name if n.kind == "call" else n.kind
        pair = self.program.fused_partner(n.name) if n.kind == "call" else None
        if pair is None or n.name != pair[0]:
            return [(key, seconds)]
        share = self._fused_shares[pair]
        return [(pair[0], seconds * share), (pair[1], seconds * (1.0 - share))]

    @cached_property
    def _fused_orders(self) -> dict[tuple[str, str], list[list[list[int]]]]:
        return fused_orders(self.graph, self.program.plan)

    def search_fused_orders(self) -> None:
        """Search the fused pairs' schedules now (a second or two per pair), at start-up."""
        _ = self._fused_orders

    def _fused_deps(self, n: Any) -> list[Any]:
        """A fused call's extra dependencies: the first waits for the second's too, the second for the first."""
        pair = self.program.fused_partner(n.name) if n.kind == "call" else None
        if pair is None:
            return []
        first, second = (type(n)("call", c, n.t) for c in pair)
        if n == second:
            return [first]
        return [d for d in self._deps(second) if d != first]

    async def _fused_call(self, n: Any, pair: tuple[str, str]) -> None:
        first, second = pair
        t = n.t
        if n.name == second:
            return  # the first call's request ran it
        recs = self.pushed.pop((first, t), []) + self.pushed.pop((second, t), [])
        ranges = [[list(r) for r in self._row_ranges(c, t) or ()] for c in pair]
        rows = [[list(r) for r in self._balanced_rows(c, t) or ()] for c in pair]  # balance_tokens: row lists
        order = self._fused_orders[pair]
        call = self._send(self.program.calls[first].ranks, "call", f"{first}+{second}", t, first,
                          lambda req: protocol.RunCall(req=req, call=first, iteration=t, ranges=ranges[0],
                                                       rows=rows[0], fused_with=second, fused_ranges=ranges[1],
                                                       fused_rows=rows[1], fused_order=order))
        for rec in recs:
            await self._wait(rec)
        replies = await self._wait(call)
        stats: dict[str, dict[str, float]] = {first: {}, second: {}}
        tag = protocol.FUSED_SECOND_STATS
        for rep in replies:
            for k, v in rep.stats.items():
                c, key = (second, k[len(tag):]) if k.startswith(tag) else (first, k)
                stats[c][key] = stats[c].get(key, 0.0) + v
            for out in rep.outputs:
                self.data_meta.setdefault((out.key, t), out.tensors)
        for c in pair:
            missing = [k for k in self.graph.call(c).output_data if (k, t) not in self.data_meta]
            if missing:
                self.fail(f"call {c} (iteration {t + 1}) produced no data for key {missing[0]!r}")
                raise RunFailed(self.failure)
            self.call_stats[t][c] = stats[c]
            self._push_outputs(c, t)
