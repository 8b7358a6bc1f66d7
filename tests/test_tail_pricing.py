"""The overheads of a tail migration as the estimator prices them (estimator/tail_cost.py), against what the
runtime does: the rows the all-gather moves, and the requests a consumer in two parts makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from realloc.api import load_experiment
from realloc.estimator.cost import CostModel
from realloc.estimator.tail_cost import consumer_parts, part_workload, row_bytes, split_ends, tail_rows
from realloc.graph.dataflow import build_graph
from realloc.lengths import ResponseLengths as R
from realloc.runtime.control.worker_tail import _metas, _row_table
from realloc.runtime.transfer.data_store import row_bytes as packed_width
from realloc.strategy import ParallelStrategy as S


@pytest.mark.parametrize("prompt_len,gen_len", [(8, 128), (3, 5)])
def test_a_migrated_row_is_priced_at_the_bytes_the_runtime_packs(prompt_len, gen_len):
    n = 3  # a generation call's input as dataset_rows gives it: prompt tokens, their lengths, dataset rows
    inputs = {"prompts": {"tokens": torch.zeros((n, prompt_len), dtype=torch.long),
                          "lengths": torch.full((n,), prompt_len, dtype=torch.long),
                          "rows": torch.arange(n)}}
    prompts = [torch.ones(prompt_len, dtype=torch.long)] * n
    table = _row_table(inputs, range(n), prompts, range(n), torch.zeros((n, 2), dtype=torch.long),
                       torch.zeros((n, 2)), [2] * n, [False] * n, prompt_len, gen_len)
    table["tail"] = torch.zeros(n, dtype=torch.bool)
    assert row_bytes(prompt_len, gen_len) == packed_width(_metas(table))


def test_a_consumer_in_two_parts_pays_a_request_more_for_its_second_transfer():
    base = load_experiment("experiments/ppo_tiny.py")
    spec = dataclasses.replace(base, gen_len=128, response_lengths=R.lognormal(8, 102))
    model = CostModel(build_graph(spec), discover=False)
    mesh = next(m for m in model.cluster.device_meshes() if m.size == 1)
    n = model.workload("actor_gen").n_seqs
    rows = tail_rows(n, 0.2)
    short, tail = split_ends(spec.response_lengths, spec.gen_len, n, rows)
    timer = model._timer(model.graph.model_config("ref_inf"))
    links, work = model.links(mesh, S(1, 1, 1)), model.workload("ref_inf")
    want = [timer.time(part_workload(work, ends, n), S(1, 1, 1), links, 1).time for ends in (short, tail)]
    got = consumer_parts(model, "ref_inf", "actor_gen", mesh, S(1, 1, 1), 1, rows)
    assert model.hw.call_overhead > 0
    assert got == pytest.approx((want[0], want[1] + model.hw.call_overhead), rel=1e-12)
    # a rule reward has no model work: its two requests, and part 2's transfer request
    co = model.hw.call_overhead
    assert consumer_parts(model, "rew_inf", "actor_gen", mesh, S(1, 1, 1), 1, rows) == (co, 2 * co)
