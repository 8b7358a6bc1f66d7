"""A generation's KV caches allocated on fresh pages (``engine.kv_alloc``, issue 31): the estimator prices one
allocation of prompt + max_new_tokens positions per micro-batch and per layer of the busiest stage, as
``models/generation.py`` makes them (counted here on the runtime's own generate), and a table without the key
prices as before."""

from __future__ import annotations

import json

import pytest
import torch

from realloc.estimator.call_time import CallTimer
from realloc.estimator.cost import CostModel
from realloc.estimator.profile_table import ProfileTable
from realloc.estimator.profiler import release_free_memory
from realloc.models.sampling import GenerationConfig
from realloc.strategy import ParallelStrategy as S

from cost_helpers import actor_timers, tiny_ppo_cost


def alloc(b: int, s: int) -> float:
    return 3e-5 + 2e-8 * b * s  # seconds per layer: rows b, cache positions s


@pytest.fixture(scope="module")
def model():
    return tiny_ppo_cost()


def timers(model):
    return actor_timers(model, {"engine.kv_alloc": alloc})


@pytest.mark.parametrize("strategy, layers", [(S(1, 1, 1), 4), (S(1, 1, 2), 2), (S(1, 1, 4), 1)])
@pytest.mark.parametrize("ends", [(1, 3, 3, 7), (5, 5, 5, 5)])
def test_each_micro_batch_allocates_its_caches_once_per_layer_of_the_busiest_stage(model, strategy, layers, ends):
    plain, extra = timers(model)
    assert model.graph.model_config("actor_gen").n_layers == 4
    prompt, slots, n_mbs = 8, 8 + 16, strategy.pp  # one wave: every micro-batch in flight
    links = model.links(model.cluster.whole, strategy)
    got = (extra.generate_varied(strategy, links, len(ends), prompt, ends, n_mbs, slots=slots).time
           - plain.generate_varied(strategy, links, len(ends), prompt, ends, n_mbs, slots=slots).time)
    assert got == pytest.approx(n_mbs * layers * alloc(len(ends), slots), rel=1e-9)
    assert plain.kv_alloc(strategy, len(ends), slots) == 0.0  # nothing measured: priced as before


def test_without_slots_the_caches_hold_the_prompt_and_the_longest_row(model):
    plain, extra = timers(model)
    links = model.links(model.cluster.whole, S(1, 1, 1))
    ends = (2, 9, 4)
    got = (extra.generate_varied(S(1, 1, 1), links, 3, 8, ends, 2).time
           - plain.generate_varied(S(1, 1, 1), links, 3, 8, ends, 2).time)
    assert got == pytest.approx(2 * 4 * alloc(3, 8 + 9), rel=1e-9)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tp 1 tiny model in this process (a one-rank gloo group, as the profiler builds its own)."""
    import torch.distributed as dist

    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout, ProcessGroupCache

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'pg'}", rank=0,
                                world_size=1)
    cfg = get_model_config("tiny")
    layout = ModelLayout.for_model(cfg, (0,), S(1, 1, 1))
    cache = ProcessGroupCache()
    cache.ensure_layouts([layout])
    return ParallelModel(cfg, cache.model_groups(layout), init="random", seed=3)


def test_a_real_generate_allocates_one_cache_of_prompt_and_new_tokens_per_micro_batch(monkeypatch, tiny_model):
    """The count the estimator prices, taken from the runtime: a generation of 5 prompts (lengths 3..6) in 2
    micro-batches of max_new_tokens 7 allocates one set of caches per micro-batch, of its rows x (its longest
    prompt + 7) positions, whatever the rows' lengths."""
    from realloc.models.generation import generate

    m = tiny_model
    seen: list[tuple[int, int]] = []
    orig = m.stage.new_kv_caches
    monkeypatch.setattr(m.stage, "new_kv_caches", lambda b, n, **kw: seen.append((b, n)) or orig(b, n, **kw))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6], [7, 8, 9]]
    out = generate(m, prompts, GenerationConfig(max_new_tokens=7, seed=3, eos_token_ids=(0,)), n_mbs=2)
    assert out.sequences.shape[0] == 5
    # even_ranges(5, 2): rows 0-2 (longest prompt 5), rows 3-4 (longest prompt 6)
    assert seen == [(3, 5 + 7), (2, 6 + 7)]


def test_a_table_from_before_the_key_prices_generation_as_before(model):
    table = ProfileTable.load("tests/data/tiny_profile_2026-11-22.json")
    assert all("engine.kv_alloc" not in sub.ops for sub in table.tp.values())
    priced = CostModel(model.graph, profile=table, discover=False)
    cfg = model.graph.model_config("actor_gen")
    timer = CallTimer(cfg, priced.layer_costs(cfg), priced.comm, priced.hw)
    assert timer.kv_alloc(S(1, 1, 1), 32, 136) == 0.0


def test_release_free_memory_leaves_live_tensors_intact():
    x = torch.arange(1 << 20, dtype=torch.float32)
    y = [torch.ones(1 << 18) for _ in range(8)]
    del y
    release_free_memory()
    assert float(x[-1]) == (1 << 20) - 1 and json.dumps(float(x.sum()))
