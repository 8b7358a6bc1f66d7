"""The planner's hooks for FlexRLHF's batch rule (benchmarks/bench_batch_rule.py, docs/heterogeneous.md "Table III at
the paper's batch rule"): a cluster of pools whose strongest pool alone holds no plan still searches (the pools
together hold what it cannot), and the search's space limits ``max_n_mbs`` (one micro-batch per call) and
``offload=False`` (every model kept on its devices)."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from realloc import cli
from realloc.api import Pool, load_experiment
from realloc.cluster import ClusterSpec
from realloc.search.build import NoFitError
from realloc.search.planner import plan_search
from realloc.search.pool_space import pool_alone
from realloc.search.report import comparison_table

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
# cpu-bf16 is the strongest pool (4x cpu's peak); at 5 MiB it cannot hold the tiny PPO alone (a plan needs ~7.4 MiB
# on one device), while both pools together can
SMALL = [Pool("cpu0", "cpu", 1), Pool("cpu1", "cpu-bf16", 1, device_memory=5 * MiB)]
EXPERIMENT = """
import dataclasses
from ppo_tiny import TinyPPO
from realloc.api import Pool, auto

@auto(pools=[Pool("cpu0", "cpu", 1), Pool("cpu1", "cpu-bf16", 1, device_memory=5 * 2**20)], batch_size=32,
      prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Small(TinyPPO):
    pass
"""


@pytest.fixture(scope="module")
def small():
    spec = load_experiment(str(ROOT / "experiments/ppo_tiny_two_kinds.py"))
    return dataclasses.replace(spec, cluster=ClusterSpec.from_pools(SMALL))


def test_the_pools_search_when_the_strongest_pool_alone_holds_no_plan(small):
    with pytest.raises(NoFitError):  # the reference: pool 1 alone, searched as a cluster of its own
        plan_search(pool_alone(small, 1), None, max_evals=2000)
    report = plan_search(small, None, max_evals=2000)
    assert report.evaluation["feasible"]
    assert report.alone is None and report.alone_pool == 1
    assert report.alone_error.startswith("no plan fits pool 1 alone: ")
    peaks = report.space.cpp.memory(report.indices)["device_peak"]
    assert peaks[0] <= 8 * 2**30 and peaks[1] <= 5 * MiB  # each pool's devices within their own memory
    table = comparison_table(report)
    assert "pool 1:cpu-bf16 alone: no plan fits pool 1 alone" in table
    assert not any(line.startswith(("heuristic", "colocate-dp")) for line in table.splitlines())  # they ran there too


def test_realloc_search_prints_the_pools_plan_and_why_the_pool_alone_has_none(tmp_path, capsys, monkeypatch):
    path = tmp_path / "small.py"
    path.write_text(textwrap.dedent(EXPERIMENT))
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    assert cli.main(["search", str(path), "--evals", "2000"]) == 0
    out = capsys.readouterr().out
    assert "searched plan" in out and "no plan fits pool 1 alone: nothing fits in memory" in out


def test_max_n_mbs_and_offload_limit_the_space():
    spec = load_experiment(str(ROOT / "experiments/ppo_tiny.py"))
    free = plan_search(spec, None, max_evals=500)
    assert any(o.n_mbs > 1 for opts in free.space.options for o in opts)  # so that the limit below can fail
    assert any(o.offload for opts in free.space.options for o in opts)
    one = plan_search(spec, None, max_evals=500, max_n_mbs=1, offload=False)
    assert all(o.n_mbs == 1 and not o.offload for opts in one.space.options for o in opts)
    assert all(p.n_mbs == 1 for p in one.plan.placements.values()) and not any(one.plan.offload.values())
