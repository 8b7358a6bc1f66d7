"""Audit, round 12: a new user's audit of the newest features (long-tail migration and streaming, partial rollouts,
token-balanced dp, ``--lengths-from``, the length distributions, pools of two kinds). Each test of a defect failed
before its fix; its docstring says what the user saw."""

from __future__ import annotations

import json

import pytest
from run_helpers import REPO

PPO = str(REPO / "experiments/ppo_tiny.py")  # gen_len 8, batch 32


def _samples(folder, text: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "samples.jsonl").write_bytes(text)
    return folder


def _record(seq: int, n: int) -> bytes:
    return (json.dumps({"iteration": 1, "seq": seq, "response_ids": list(range(n))}) + "\n").encode()


def test_lengths_from_a_samples_file_that_is_not_utf8_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    """`realloc search ppo_tiny.py --lengths-from RUN` on a samples.jsonl with a stray byte printed
    "realloc search: error: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte": neither the
    option nor the file nor the line."""
    from realloc.cli import main

    run = _samples(tmp_path / "run", _record(0, 3) + b'\xff{"seq": 1, "response_ids": [1]}\n')
    assert main(["search", PPO, "--lengths-from", str(run), "--evals", "10"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--lengths-from" in err and "samples.jsonl line 2" in err and "UTF-8" in err, err


def test_lengths_from_a_run_killed_mid_write_read_its_whole_records(tmp_path):
    """A run killed while appending to samples.jsonl leaves its last line cut off; `--lengths-from` that run stopped
    at "line 3 is not JSON", so the lengths of a killed run could not be used without editing its records. The cut
    line is skipped now; a broken line followed by others is still refused, naming it."""
    from realloc.lengths import ResponseLengths, lengths_from_run

    whole = _record(0, 3) + _record(1, 5)
    run = _samples(tmp_path / "cut", whole + _record(2, 7)[:25])
    assert lengths_from_run(run) == ResponseLengths.empirical([3, 5])
    run = _samples(tmp_path / "broken", _record(0, 3) + _record(2, 7)[:25] + b"\n" + _record(1, 5))
    with pytest.raises(ValueError, match="samples.jsonl line 2 is not JSON"):
        lengths_from_run(run)


def test_lengths_from_a_run_with_responses_longer_than_gen_len_is_refused_naming_gen_len(tmp_path, capsys):
    """`--lengths-from` a run of another experiment (responses of 100000 tokens) searched ppo_tiny (gen_len 8) on
    "empirical (2 responses, 2-100000 tokens), mean 5.0 of at most 8" without a word: the foreign lengths were priced
    cut at gen_len. No generation of this experiment writes a response longer than gen_len (multi-turn budgets
    count observations too), so it is one line now."""
    from realloc.cli import main
    from realloc.lengths import lengths_from_run

    run = _samples(tmp_path / "foreign", _record(0, 100000) + _record(1, 2))
    assert main(["search", PPO, "--lengths-from", str(run), "--evals", "10"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "up to 100000 tokens" in err and "gen_len=8" in err, err
    assert lengths_from_run(run).counts == ((2, 1), (100000, 1))  # without gen_len: as before


def test_an_empirical_histogram_given_out_of_order_describes_its_shortest_and_longest():
    """`ResponseLengths("empirical", counts=((5, 1), (2, 1)))` described itself as "5-2 tokens" in `realloc search`'s
    workload line; the counts are kept by length now, and equal the same histogram given in order."""
    from realloc.lengths import ResponseLengths

    d = ResponseLengths("empirical", counts=((5, 1), (2, 1)))
    assert "2-5 tokens" in d.describe(8) and d == ResponseLengths.empirical([2, 5])


def test_a_tail_threshold_above_the_batch_with_chunks_names_the_threshold_not_negative_rows():
    """A hand-written `"tail": {"actor_gen": {"rows": 40, "instances": 0, "chunks": 2}}` on a call of 32 rows said
    "has chunks=2, more than the -8 rows that finish before the last split point"; it names rows now."""
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan, validate_plan
    from realloc.overrides import load_with_overrides

    graph = build_graph(load_with_overrides(PPO, []))
    places = {c: ("localhost", 2, 1, 1, 1) for c in graph.spec.call_names}
    plan = ExecutionPlan.by_hand(graph, places, tail={"actor_gen": (40, 0, 2)})
    with pytest.raises(ValueError) as e:
        validate_plan(plan, graph)
    assert "rows=40 must be below" in str(e.value) and "-8" not in str(e.value)


def test_lengths_from_a_partial_rollouts_run_count_each_response_once_whole(tmp_path):
    """`realloc run arith_grpo_eos.py --set grpo.partial_rollout_tokens=2 --set max_staleness=1 --set sample_every=1
    --iterations 2`, then `--lengths-from` that run: iteration 1's 256 responses, cut at 2 tokens and pending, were
    counted as responses of 2 tokens beside their whole versions of iteration 2 (histogram {1: 2, 2: 265, 3: 38,
    4: 207} against the finished {1: 1, 2: 10, 3: 38, 4: 207}), so the search priced lengths the cut had made.
    A pending group's responses are marked in samples.jsonl now (`"pending": true`) and skipped."""
    import torch

    from realloc.lengths import ResponseLengths, lengths_from_run
    from realloc.runtime.records.text_io import SampleLog, write_samples
    from realloc.runtime.wire.protocol import SamplePart

    T, glen = 4, torch.tensor([2, 2, 3, 4])
    gen_mask = torch.arange(T).view(1, T) < glen.view(-1, 1)
    trained = torch.tensor([False, False, True, True]).view(-1, 1)  # group 0 pending (rows 0, 1), group 1 trained
    seq = {"tokens": torch.arange(4 * (2 + T)).view(4, 2 + T), "prompt_lens": torch.full((4,), 2),
           "gen_mask": gen_mask, "loss_mask": gen_mask & trained}
    parts = SampleLog(None, every=1, count=4).parts(0, range(4), "seq", seq, scores=torch.zeros(4),
                                                    logp=torch.zeros(4, T))
    parts = [SamplePart.model_validate(p.model_dump()) for p in parts]  # as the wire carries them
    assert [p.fields.get("pending") for p in parts] == [True, True, None, None]
    write_samples(tmp_path, 0, {(p.key, p.seq): p.fields for p in parts})
    assert lengths_from_run(tmp_path) == ResponseLengths.empirical([3, 4])
    (tmp_path / "first").mkdir()  # a run stopped while its only logged groups were pending
    write_samples(tmp_path / "first", 0, {(p.key, p.seq): p.fields for p in parts[:2]})
    with pytest.raises(ValueError, match="only 2 responses of partial-rollout groups still pending"):
        lengths_from_run(tmp_path / "first")


def test_the_search_keeps_its_winner_when_the_winners_placement_has_no_plain_row():
    """`plan_search` of grpo_h100_h20 with lognormal lengths (median 2, p99 8), seed 4, 3000 evaluations, one thread
    stopped with "call 'actor_gen': placement mesh h20-01:4-7 dp2·tp2·pp1 n_mbs=32 is not among the candidates (it
    does not fit in memory or was pruned)" after the search had found its plan: the pruning (a row slower alone than
    a baseline's whole iteration) had kept the winner's row with its tail and dropped the same placement's plain row,
    which the report prices beside the winner. Now such a placement has no plain plan to show (and
    `drop_idle_streams` keeps an entry it cannot drop)."""
    import dataclasses

    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.lengths import ResponseLengths
    from realloc.search.build import PlanSpace
    from realloc.search.tail_space import drop_idle_streams, untailed_indices

    base = load_experiment(str(REPO / "experiments/ppo_tiny.py"))
    graph = build_graph(dataclasses.replace(base, gen_len=128, response_lengths=ResponseLengths.lognormal(8, 102.4)))
    full = PlanSpace.build(graph, CostModel(graph, discover=False), max_n_mbs=2)
    g = full.problem.call_names.index("actor_gen")
    streamed = next(i for i in range(len(full.options[g])) if (t := full.tail_of(g, i)) is not None and t.streams_only)
    keep = [list(range(len(k))) for k in full.problem.candidates]
    keep[g] = [i for i in keep[g] if full.options[g][i] != full.options[g][streamed] or full.tail_of(g, i) is not None]
    space = full.restrict(keep)  # the stream rows of one placement kept, its plain row dropped
    idx = space.indices_of(full.to_plan(_with_row(full, g, streamed), "x"))
    plan = space.to_plan(idx, "x")
    assert plan.tail and untailed_indices(space, plan, set(plan.tail)) is None
    assert untailed_indices(full, plan, set(plan.tail)) is not None  # in the whole space it has one
    # the entry splits no call (every call on device 0): dropping it needs the plain row; it stopped with the error
    assert drop_idle_streams(space, idx) is idx


def _with_row(space, g: int, row: int):
    """A plan of ``space``: every call at its first candidate, ``g`` at ``row``."""
    import numpy as np

    idx = np.zeros(len(space.problem.call_names) + len(space.problem.fused), np.int32)
    idx[g] = row
    return idx


def test_a_search_whose_winner_lost_its_plain_row_to_pruning_returns_its_plan():
    """The search of the docstring above, end to end (about 25 s at load 20)."""
    import dataclasses

    from realloc.api import load_experiment
    from realloc.lengths import ResponseLengths
    from realloc.search.planner import plan_search

    exp = load_experiment(str(REPO / "experiments/grpo_h100_h20.py"))
    r = plan_search(dataclasses.replace(exp, response_lengths=ResponseLengths.lognormal(2, 8)), None, seed=4,
                    max_evals=3000, n_threads=1)
    assert r.plan.tail and r.no_tail is not None and not r.no_tail.tail


def test_a_full_disk_while_the_carried_rows_are_saved_names_the_file(tmp_path):
    """A worker saving a checkpoint's carried rows of partial rollouts (`partial/<call>/<slots>.json`) on a full disk
    stopped the run with `worker 0: No space left on device`: no file named (the checkpoint's other files name
    theirs). It names the file now."""
    from realloc.algorithms.partial_rollout import PartialRollouts
    from realloc.runtime.control.worker_errors import reply_error
    from realloc.runtime.control.worker_partial import PartialStore

    store = PartialStore(max_staleness=1, plan_staleness=0)
    store.states["actor_gen"], store.writes["actor_gen"] = PartialRollouts(2, 1), (True, range(0, 16))
    target = tmp_path / "partial/actor_gen/0-16.json"
    target.parent.mkdir(parents=True)
    (target.parent / "0-16.json.part").symlink_to("/dev/full")  # every write there: ENOSPC
    with pytest.raises(OSError) as e:
        store.save(tmp_path, 3)
    assert reply_error(e.value).startswith(f"{target}: No space left on device")  # (then where: this test)
