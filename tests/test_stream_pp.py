"""Streaming at pp > 1, the generation's side (models/stream_pipeline.py; docs/tail-semantics.md, Limits): a
generation on two pipeline stages split at several points and continued in place gives the plain pp 2 generation's
tokens and log-probs bit for bit, and both stages count the same running rows after every step, the counts a hand
computation from the length schedule gives (so every stage stops at the same split point)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from model_helpers import build_model
from realloc.graph.tail import split_thresholds
from realloc.models.config import get_model_config
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_stream_chunks import split_at
from test_streaming import _prompts, _responses


def _split_pp2(ctx, gconfig, thresholds, n_mbs):
    from realloc.models.stream_decode import SplitGeneration

    model = build_model(ctx, get_model_config("tiny"), 1, 1, 2, seed=3)
    rows = _prompts()
    plain = _responses(model.generate([r.tolist() for r in rows], gconfig, seq_ids=range(N_ROWS), n_mbs=n_mbs))
    return (ctx.rank, plain, *split_at(SplitGeneration(model, rows, gconfig, range(N_ROWS), n_mbs), thresholds))


@pytest.mark.parametrize("n_mbs", [1, 3])
def test_a_pp2_generation_split_at_several_points_is_the_plain_one(pool, n_mbs):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(), temperature=0.9,
                               length_schedule=SCHEDULE)
    thresholds = split_thresholds(N_ROWS, 2, 3)
    results = sorted(pool.run(_split_pp2, gconfig, thresholds, n_mbs))
    lengths = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    steps = [min(t for t in range(MAX_NEW) if sum(n > t + 1 for n in lengths) <= th) for th in thresholds]
    want_counts = [sum(n > t + 1 for n in lengths) for t in range(steps[-1] + 1)]
    for rank, plain, got, chunks, counts in results:  # stage 0, then stage 1
        assert counts == want_counts, rank  # one count per step, the same on both stages
        prev = -1
        for step, chunk in zip(steps, chunks):
            assert chunk == [i for i, n in enumerate(lengths) if prev + 1 < n <= step + 1], rank
            prev = step
        for i, (tok, lp) in enumerate(plain):  # bit for bit: the same decode steps, nothing re-run
            assert got[i][0] == tok and torch.equal(got[i][1], lp), (rank, i)
    assert results[0][1][0][0] == results[1][1][0][0]  # both stages hold the tokens


def test_a_pp2_generation_streamed_to_another_device_matches_the_unstreamed_run(tmp_path):
    """PPO on four devices: generation at pp 2 on devices 0-1 streams its finished rows at the split point to the
    inference calls on device 2, which run in two parts (the train steps on devices 2-3); samples, metrics and the
    whole checkpoint (optimizer state included) equal the same pp 2 run without the entry."""
    from test_streaming import R_T, _experiment, _run, assert_same_runs

    exp = _experiment(tmp_path, "ppo")
    exp.write_text(exp.read_text().replace("n_devices_per_node=2", "n_devices_per_node=4"))
    gen = ("localhost:0-1", 1, 1, 2, 2)  # dp 1, tp 1, pp 2, two micro-batches
    places = dict(infer=("localhost:2", 1, 1, 1, 1), train=("localhost:2-3", 2, 1, 1, 1))
    streamed = _run(tmp_path, exp, "streamed", {"actor_gen": (R_T, 0)}, gen, **places)
    plain = _run(tmp_path, exp, "plain", {}, gen, **places)
    parts: dict[tuple[int, str], list[int]] = {}  # the inference calls ran in two parts: the rest, then the tail
    for line in (streamed / "logs" / "worker2.log").read_text().splitlines():
        m = re.search(r"iteration (\d+) call (\w+_inf) rows \[(\[.*?\])\]", line)
        if m:
            parts.setdefault((int(m.group(1)), m.group(2)), []).append(len(json.loads(m.group(3))))
    assert parts and all(len(n) == 2 and n[0] + n[1] == 32 and 0 < n[1] <= R_T for n in parts.values()), parts
    assert_same_runs(streamed, plain)
