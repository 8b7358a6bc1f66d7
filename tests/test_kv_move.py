"""A long-tail migration that moves KV caches (issue 31 item 3; models/kv_move.py, docs/streaming.md "Moving the KV
caches"): the tail decodes on from phase 1's caches, cut at the migration point, with no prefill re-run. Against
the unmigrated generation of the same rows: bit for bit where the tail replica decodes one source micro-batch's
rows (the unmigrated run's very operations), the tokens and log-probs within float tolerance where rows of several
micro-batches decode together (another batch size); the sliding window (Mistral) and rows that phase 1 decoded
past the migration point included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_helpers import build_model
from realloc.models.config import get_model_config
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_length_schedule import _prompts as _prompt_lists
from test_tail_runahead import _LateCounts

GCONFIG = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(40, 41), temperature=0.9,
                           length_schedule=SCHEDULE)


def _config(window: int | None):
    cfg = get_model_config("tiny")
    return cfg if window is None else dataclasses.replace(cfg, sliding_window=window)


def _responses(out):
    return [(out.sequences[b, out.prompt_lengths[b]:out.lengths[b]].tolist(),
             out.logprobs[b, out.prompt_lengths[b]:out.lengths[b]]) for b in range(out.lengths.numel())]


def _moved_on_one_replica(ctx, window, n_mbs, threshold, lag):
    """Plain generation, and phase 1 (counts ``lag`` steps late) then the tail decoded from its cut caches."""
    from realloc.models.kv_move import cut_row, decode_moved
    from realloc.models.tail_decode import SyncCounts, decode_until

    model = build_model(ctx, _config(window), 1, 1, 1, seed=3)
    if model is None:
        return None
    rows = [torch.tensor(p) for p in _prompt_lists()]
    plain = _responses(model.generate([r.tolist() for r in rows], GCONFIG, seq_ids=range(N_ROWS), n_mbs=n_mbs))
    counts = SyncCounts(lambda n: n) if lag == 0 else _LateCounts(lag)
    one = decode_until(model, rows, GCONFIG, range(N_ROWS), n_mbs, counts, threshold)
    got = dict(zip(one.finished, _responses(one.output)))
    if one.ahead:
        got.update(zip(one.ahead, _responses(one.ahead_output)))
    held = sorted(one.held)
    width = max(one.held[i][2] for i in held)
    caches = [cut_row(one.held[i][0], one.held[i][1], one.held[i][2], rows[i].numel(), one.step) for i in held]
    caches = [[(k.clone(), v.clone()) for k, v in kv] for kv in caches]  # as if moved: copies
    pos = [one.tail.seq_ids.index(i) for i in held]
    out = decode_moved(model, [rows[i] for i in held], held, one.tail.tokens[pos], one.tail.logprobs[pos], caches,
                       width, GCONFIG)
    got.update(zip(held, _responses(out)))
    return plain, [got[i] for i in range(N_ROWS)], held, one.ahead, one.step


@pytest.mark.parametrize("window", [None, 4])
def test_one_micro_batchs_moved_tail_is_the_unmigrated_run_bit_for_bit(pool, window):
    plain, moved, held, ahead, step = next(r for r in pool.run(_moved_on_one_replica, window, 1, 3, 0) if r)
    assert step >= 1 and held and not ahead
    for i, ((a, lpa), (b, lpb)) in enumerate(zip(plain, moved)):
        assert a == b and torch.equal(lpa, lpb), i


@pytest.mark.parametrize("window,n_mbs,lag", [(None, 3, 0), (4, 2, 0), (None, 1, 10), (4, 1, 10)])
def test_rows_of_several_micro_batches_or_decoded_past_the_point_keep_their_tokens(pool, window, n_mbs, lag):
    plain, moved, held, ahead, step = next(r for r in pool.run(_moved_on_one_replica, window, n_mbs, 4, lag) if r)
    assert held and (ahead if lag else True)
    for i, ((a, lpa), (b, lpb)) in enumerate(zip(plain, moved)):
        assert a == b and torch.allclose(lpa, lpb, atol=1e-5), i
        if i in ahead:  # finished by phase 1 past the migration point: kept as decoded, bit for bit
            assert torch.equal(lpa, lpb), i


def _interface(ctx, inputs):
    """A generation interface: the rows' prompts, one sequence id per row (as the built-in ones)."""
    p = inputs["p"]
    rows = [p["prompt"][r, :int(p["plen"][r])] for r in range(p["plen"].numel())]
    out = ctx.model.generate(rows, ctx.config, seq_ids=ctx.ids, n_mbs=ctx.n_mbs)
    return dict(zip(ctx.ids, _responses(out)))


def _blocking_counts(group, dp):
    """Phase 1's counts with a blocking all-reduce at every step: no replica runs ahead of the migration point, so
    the rows at it are exactly the unmigrated run's."""
    import torch.distributed as dist

    from realloc.models.tail_decode import SyncCounts

    def total(n):
        t = torch.tensor([n])
        dist.all_reduce(t, group=group)
        return int(t)

    counts = SyncCounts(total)
    counts.describe = lambda: "blocking"
    return counts


def _migrated(ctx, split, rows_t, kv, n_mbs, window, blocking, tp=1):
    """dp 2 (at ``tp``): replica k holds the rows ``split[k]``; the unmigrated generation, then the call with a
    tail entry."""
    from realloc.algorithms.context import CallContext
    from realloc.graph.tail import TailMigration
    from realloc.runtime.control import worker_tail

    if blocking:
        worker_tail.AsyncCounts = _blocking_counts  # this worker process only
    model = build_model(ctx, _config(window), 2, tp, 1, seed=3)
    ids = split[model.groups.dp_rank]
    lists = _prompt_lists()
    prompts = torch.zeros((len(ids), max(map(len, lists))), dtype=torch.long)  # one width on every replica
    for r, i in enumerate(ids):
        prompts[r, :len(lists[i])] = torch.tensor(lists[i])
    inputs = {"p": {"prompt": prompts, "plen": torch.tensor([len(lists[i]) for i in ids])}}
    call = CallContext(call=None, model=model, optimizer=None, config=GCONFIG, prompt_len=0, gen_len=MAX_NEW,
                       seed=5, iteration=0, ids=list(ids), batch_size=N_ROWS, n_mbs=n_mbs)
    plain = _interface(call, inputs)
    res, held = worker_tail.migrating_generation(call, _interface, inputs, TailMigration(rows=rows_t, instances=1,
                                                                                          kv=kv), "gen")
    return plain, res or {}, held


def _both(results):
    plain, moved = {}, {}
    for p, r, held in results:
        plain.update(p)
        moved.update(r)
        assert sorted(r) == sorted(held)
    assert sorted(moved) == list(range(N_ROWS))
    return plain, moved


# ids 0 and 5 are the long rows (12 and 21 tokens); R_t = 3 leaves them after step 3
ONE_SOURCE = [[1, 2, 3, 4, 6, 7], [0, 5, 8, 9, 10, 11]]  # both on replica 1: their caches cross to replica 0
TWO_SOURCES = [[0, 1, 2, 3, 4, 6], [5, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize("window", [None, 4])
def test_at_dp_2_caches_moved_over_the_wire_decode_bit_for_bit(pool, window):
    plain, moved = _both(pool.run(_migrated, ONE_SOURCE, 3, "move", 1, window, True))
    for i in range(N_ROWS):
        assert plain[i][0] == moved[i][0] and torch.equal(plain[i][1], moved[i][1]), i


def test_at_tp_2_each_rank_moves_its_own_heads_bit_for_bit(tmp_path):
    from mp_pool import GlooPool

    with GlooPool(4, tmp_path) as four:
        plain, moved = _both(four.run(_migrated, ONE_SOURCE, 3, "move", 1, None, True, 2))
    for i in range(N_ROWS):
        assert plain[i][0] == moved[i][0] and torch.equal(plain[i][1], moved[i][1]), i


@pytest.mark.parametrize("kv,split,n_mbs", [("move", TWO_SOURCES, 1), ("move", ONE_SOURCE, 2),
                                            ("prefill", TWO_SOURCES, 1)])
def test_at_dp_2_tails_of_several_sources_keep_their_tokens(pool, kv, split, n_mbs):
    plain, moved = _both(pool.run(_migrated, split, 3, kv, n_mbs, None, False))
    for i in range(N_ROWS):
        assert plain[i][0] == moved[i][0] and torch.allclose(plain[i][1], moved[i][1], atol=1e-5), i


def _cost_model():
    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.lengths import ResponseLengths

    base = load_experiment("experiments/ppo_tiny.py")
    spec = dataclasses.replace(base, gen_len=128, response_lengths=ResponseLengths.lognormal(8, 102))
    from realloc.estimator.profile_table import ProfileTable

    return CostModel(build_graph(spec), profile=ProfileTable.load("profiles/cpu/tiny.json"), discover=False)


def test_the_move_is_priced_as_its_bytes_over_the_dp_link_and_its_copies():
    from realloc.estimator.tail_cost import migration_cost, migration_step, row_bytes, tail_phase_cost, tail_rows
    from realloc.strategy import ParallelStrategy as S

    model = _cost_model()
    s, call = S(2, 1, 1), "actor_gen"
    mesh = next(m for m in model.cluster.device_meshes() if m.size == 2)
    work, cfg = model.workload(call), model.graph.model_config(call)
    rows = tail_rows(work.n_seqs, 0.2)
    cut, links = migration_step(model, call, rows), model.links(mesh, s)
    timer = model._timer(cfg, model.call_precision(call))
    written = work.prompt_len + cut
    # by hand: K and V of every layer's kv heads, each head_dim wide, in the compute dtype, at every written slot;
    # the tail replica's own half of the rows stays, the other half crosses
    row = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * model.call_precision(call).param * written
    transfer = model.comm.time("p2p", 2, rows / 2 * row, links.dp)
    copies = sum(cfg.n_layers * timer._engine("engine.row_drop_used", 1, b, written) for b in (-(-rows // 2), rows))
    assert copies > 0 and transfer > 0
    ends = sorted(work.lengths.order_statistics(work.gen_len, work.n_seqs))[work.n_seqs - rows:]
    alloc = timer.kv_alloc(s, rows, work.prompt_len + work.gen_len, work.prompt_len + sum(ends) / rows - 1)
    share = work.n_seqs // 2
    gather = (model.comm.time("all_gather", 2, share * (row_bytes(work.prompt_len, work.gen_len) + 17), links.dp)
              - model.comm.time("all_gather", 2, share * row_bytes(work.prompt_len, work.gen_len), links.dp))
    base = migration_cost(model, call, mesh, s, rows, 1)
    moved, phase2, flag = tail_phase_cost(model, call, mesh, s, rows, 1, "move")
    assert flag and moved == pytest.approx(base + gather + copies + transfer + alloc, rel=1e-12)
    prefilled, phase2_p, flag_p = tail_phase_cost(model, call, mesh, s, rows, 1, "prefill")
    assert not flag_p and phase2_p == phase2 and prefilled > base  # the same decoding either way
    auto = tail_phase_cost(model, call, mesh, s, rows, 1)
    assert auto == ((moved, phase2, True) if moved <= prefilled else (prefilled, phase2, False))


def _wire_bytes(ctx, window):
    from realloc.estimator.hardware import Precision
    from realloc.estimator.kv_move_cost import row_kv_bytes
    from realloc.models.kv_move import packed_size
    from realloc.strategy import ParallelStrategy as S

    model = build_model(ctx, _config(window), 1, 1, 1, seed=3)
    if model is None:
        return None
    return packed_size(model, [5, 2], 3) * 4, sum(row_kv_bytes(model.cfg, S(1, 1, 1), Precision.for_dtype("fp32"), s)
                                                  for s in (5 + 3, 2 + 3))


def test_the_priced_bytes_are_those_the_runtime_sends(pool):
    sent, priced = next(r for r in pool.run(_wire_bytes, None) if r)
    assert sent == priced > 0


def test_a_kv_choice_reads_writes_and_is_checked():
    from realloc.graph.tail import TailMigration, check_tail, same_tail

    old = TailMigration(rows=3, instances=1)
    assert old.kv == "auto" and old.moves_kv and "kv" not in old.model_dump()  # plans of before: the same JSON
    forced = TailMigration.model_validate({"rows": 3, "instances": 1, "kv": "prefill"})
    assert not forced.moves_kv and forced.model_dump()["kv"] == "prefill" and same_tail(old, forced)
    with pytest.raises(ValueError, match="kv"):
        TailMigration.model_validate({"rows": 3, "instances": 1, "kv": "copy"})
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan

    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))
    both = {c: ("localhost", 2, 1, 1, 1) for c in graph.spec.call_names}
    shown = ExecutionPlan.by_hand(graph, both, source="hand", tail={"actor_gen": forced}).table()
    assert "moves its last 3 running rows to 1 dp replica(s), re-running their prefill;" in shown
    streamed = ExecutionPlan.by_hand(graph, both, source="hand", tail={"actor_gen": (3, 0)})
    with pytest.raises(ValueError, match="kv='move'.*stream-only"):
        check_tail(graph, streamed.placements, {"actor_gen": TailMigration(rows=3, instances=0, kv="move")})


def test_ppo_runs_that_move_the_caches_and_that_rerun_the_prefill_match(tmp_path):
    """Whole runs (2 iterations, dp 2, R_t = 4 rows to replica 0, the inference calls streamed on device 1): the same
    samples, rewards, losses, and final parameters and optimizer state either way (both against the unmigrated run:
    tests/test_streaming.py, whose runs move the caches, the default)."""
    from realloc.graph.tail import TailMigration
    from test_streaming import R_T, _experiment, _run, assert_same_runs

    exp = _experiment(tmp_path, "ppo")
    runs = {kv: _run(tmp_path, exp, kv, {"actor_gen": TailMigration(rows=R_T, instances=1, kv=kv)})
            for kv in ("move", "prefill")}
    logs = {kv: (d / "logs" / "worker0.log").read_text() for kv, d in runs.items()}
    assert "caches moved" in logs["move"] and "caches moved" not in logs["prefill"]  # the tail replica's clock
    assert_same_runs(runs["move"], runs["prefill"])
