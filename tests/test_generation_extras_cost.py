"""A generation's host work beyond its decode steps, as the estimator prices it (estimator/call_time.py,
``CallTimer.row_drops`` and ``engine.schedule_step``), against a count of what ``models/generation.py`` does: a copy
of the running rows' KV caches (one per layer) each time rows finish while others run on, and, with a length
schedule, a ban and a forced EOS in every step's draw (prefill included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.graph.dataflow import build_graph
from realloc.lengths import ResponseLengths as R
from realloc.models.generation import drop_rows
from realloc.models.llama import KVCache
from realloc.strategy import ParallelStrategy as S

from cost_helpers import actor_timers, tiny_ppo_cost


def drop(b: int, s: int) -> float:
    return 1e-5 + 1e-8 * b * s  # seconds per layer, rows kept b, cache positions s


def schedule(b: int) -> float:
    return 2e-5 + 1e-6 * b


@pytest.fixture(scope="module")
def model():
    return tiny_ppo_cost()


def timers(model):
    return actor_timers(model, {"engine.row_drop": drop, "engine.schedule_step": lambda b, s: schedule(b)})


@pytest.mark.parametrize("ends", [(1, 3, 3, 7), (5, 5, 5, 5), (2, 4, 6, 8, 8, 9)])
def test_drops_and_scheduled_draws_are_counted_as_generation_runs_them(model, ends):
    plain, extra = timers(model)
    s, prompt, slots, n_mbs = S(1, 1, 1), 8, 8 + 16, 2
    links = model.links(model.cluster.whole, s)
    got = (extra.generate_varied(s, links, len(ends), prompt, ends, n_mbs, slots=slots, scheduled=True).time
           - plain.generate_varied(s, links, len(ends), prompt, ends, n_mbs, slots=slots, scheduled=True).time)
    # count it as generation.py runs it: step t (0 = prefill) draws for the rows still running; after it the rows
    # whose length is t + 1 stop, and if others run on, drop_rows copies their caches in every layer
    layers, want = model.graph.model_config("actor_gen").n_layers, 0.0
    for t in range(max(ends)):
        running = sum(1 for e in ends if e > t)
        want += schedule(running)
        stop = sum(1 for e in ends if e == t + 1)
        if stop and running - stop:
            want += layers * drop(running - stop, slots)
    assert got == pytest.approx(n_mbs * want, rel=1e-9)


def test_without_a_schedule_only_the_drops_count_and_pp_splits_the_layers(model):
    plain, extra = timers(model)
    ends, slots = (1, 3, 3, 7), 40
    for s, layers in ((S(1, 1, 1), 4), (S(1, 1, 2), 2)):
        assert model.graph.model_config("actor_gen").n_layers == 4
        assert extra.row_drops(s, ends, slots) == pytest.approx(layers * (drop(3, slots) + drop(1, slots)))
        assert plain.row_drops(s, ends, slots) == 0.0  # nothing measured: priced as before
    links = model.links(model.cluster.whole, S(1, 1, 1))
    got = (extra.generate_varied(S(1, 1, 1), links, 4, 8, ends, 1, slots=slots).time
           - plain.generate_varied(S(1, 1, 1), links, 4, 8, ends, 1, slots=slots).time)
    assert got == pytest.approx(4 * (drop(3, slots) + drop(1, slots)))


def test_a_length_schedule_in_the_settings_marks_the_generation_scheduled():
    base = load_experiment("experiments/ppo_tiny.py")
    ppo = dataclasses.replace(base.config.ppo, length_schedule=R.lognormal(8, 64))
    scheduled = dataclasses.replace(base, config=dataclasses.replace(base.config, ppo=ppo))
    for spec, want in ((base, False), (scheduled, True)):
        model = CostModel(build_graph(spec), discover=False)
        assert model.workload("actor_gen").scheduled is want
        assert model.workload("ref_inf").scheduled is False


def test_drop_rows_keeps_the_running_rows_caches():
    caches = [KVCache(torch.arange(24.0).view(3, 1, 4, 2), -torch.arange(24.0).view(3, 1, 4, 2)) for _ in range(2)]
    keep = torch.tensor([True, False, True])
    for old, new in zip(caches, drop_rows(caches, keep)):
        assert torch.equal(new.k, old.k[[0, 2]]) and torch.equal(new.v, old.v[[0, 2]])
