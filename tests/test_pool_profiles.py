"""Profiles of a pool whose dtype is not its kind's own (issue 32, docs/heterogeneous.md "How pools are priced"):
a table measured in that dtype when one exists, else the kind's table of a sibling dtype (same size, both at the
kind's peak) unscaled, else the roofline; ``realloc profile --dtype`` measures the right table."""

from __future__ import annotations

import argparse
import textwrap

import pytest

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.estimator.hardware import load_hardware_spec
from realloc.estimator.profile_table import discover_profiles, sibling_dtype
from realloc.graph.dataflow import build_graph
from realloc.strategy import ParallelStrategy

# Two pools of H200s (a measured bf16 table of qwen2-0.5b ships in profiles/h200-141g/); the second in fp16.
EXPERIMENT = """
import dataclasses
from realloc.algorithms.ppo.ppo_config import ppo_rpcs
from realloc.api import Pool, auto

@auto(pools=[Pool("h01", "h200-141g", 8), Pool("h02", "h200-141g", 8, dtype="fp16")], batch_size=64,
      prompt_len=128, gen_len=128)
@dataclasses.dataclass
class TwoDtypes:
    @property
    def rpcs(self):
        return ppo_rpcs(actor="qwen2-0.5b", critic="qwen2-0.5b-critic", n_minibatches=1)
"""


def test_an_fp16_pool_of_a_bf16_kind_is_priced_from_the_bf16_table_unscaled(tmp_path):
    path = tmp_path / "two_dtypes.py"
    path.write_text(textwrap.dedent(EXPERIMENT))
    graph = build_graph(load_experiment(str(path)))
    cost, roof = CostModel(graph), CostModel(graph, discover=False)
    bf16, fp16 = cost.pool_models
    assert (bf16.hw.dtype, fp16.hw.dtype) == ("bf16", "fp16")
    cfg = graph.model_config("actor_gen")
    assert bf16.layer_costs(cfg).source == "profile"
    assert fp16.layer_costs(cfg).source == "profile (bf16 table for fp16)"
    m0, m1 = (graph.spec.cluster.mesh(n) for n in ("h01", "h02"))
    s = ParallelStrategy(dp=4, tp=2, pp=1)
    for call in ("actor_gen", "actor_train", "ref_inf"):
        # the same table, no factor: the same seconds on both pools (both dtypes run at the H200's peak)
        assert cost.call_cost(call, m1, s, 2).time == cost.call_cost(call, m0, s, 2).time, call
        assert cost.call_cost(call, m1, s, 2).time != roof.call_cost(call, m1, s, 2).time, call
    assert roof.pool_models[1].layer_costs(cfg).source == "roofline"  # without the measured table


def test_sibling_dtypes_are_the_kinds_own_of_the_same_size():
    h200 = load_hardware_spec("h200-141g")
    fp16 = h200.model_copy(update={"dtype": "fp16"})
    assert sibling_dtype(fp16, "bf16") and sibling_dtype(h200, "fp16") and not sibling_dtype(h200, "bf16")
    v100 = load_hardware_spec("v100-32g")  # fp16 only: a bf16 table is no V100's
    assert not sibling_dtype(v100, "bf16")
    mixed = h200.model_copy(update={"dtype": "bf16", "dtypes": ("bf16", "fp32")})
    assert not sibling_dtype(mixed, "fp32")  # 4-byte elements: other bytes, other rates -> roofline
    assert all(t.dtype == "bf16" for t in discover_profiles("h200-141g"))


def test_profile_dtype_is_checked_and_written_beside_the_kinds_own_table(tmp_path, monkeypatch):
    from realloc.estimator.profile_cli import build_job

    monkeypatch.setenv("REALLOC_PROFILES", str(tmp_path))
    args = argparse.Namespace(model="tiny", tp="1", device="cuda", kind="h200-141g", dtype="fp16", out=None)
    with pytest.raises(ValueError, match="GPUs"):  # no GPU here; the dtype was accepted before that
        build_job(args)
    bad = argparse.Namespace(**{**vars(args), "dtype": "fp32"})
    with pytest.raises(ValueError, match=r"--dtype fp32: device kind 'h200-141g' computes in bf16, fp16"):
        build_job(bad)
