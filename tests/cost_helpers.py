"""Layer costs for estimator tests: a base's (the roofline's) with chosen engine overheads as if measured."""

from __future__ import annotations

from typing import Callable


class MeasuredEngine:
    """``base``'s layer costs, with ``engine[key](b, s)`` seconds for the engine overheads it names (the keys of
    ``profiler.ENGINE_KEYS``) and ``base``'s for the rest."""

    def __init__(self, base, engine: dict[str, Callable[[int, int], float]]) -> None:
        self.base, self.source, self.extra = base, base.source, engine

    def op(self, *a):
        return self.base.op(*a)

    def optimizer(self, n):
        return self.base.optimizer(n)

    def interface(self, *a):
        return self.base.interface(*a)

    def engine(self, key, tp, b, s):
        f = self.extra.get(key)
        return self.base.engine(key, tp, b, s) if f is None else f(b, s)


def tiny_ppo_cost():
    """The cost model of experiments/ppo_tiny.py on the roofline (no profile tables)."""
    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph

    return CostModel(build_graph(load_experiment("experiments/ppo_tiny.py")), discover=False)


def actor_timers(model, engine: dict[str, Callable[[int, int], float]]):
    """The actor generation's ``CallTimer`` of ``model``, as it is and with the engine overheads ``engine``."""
    from realloc.estimator.call_time import CallTimer

    cfg = model.graph.model_config("actor_gen")
    base = model.layer_costs(cfg)
    return (CallTimer(cfg, base, model.comm, model.hw),
            CallTimer(cfg, MeasuredEngine(base, engine), model.comm, model.hw))
