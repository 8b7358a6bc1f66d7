"""Streaming across pools (issue 32; docs/heterogeneous.md, "Streaming across pools"): a generation on one pool
hands its finished rows in chunks to inference on a pool of another kind and dtype; the run equals the unstreamed
run on the same two pools (samples, metrics, the whole checkpoint with optimizer state)."""

from __future__ import annotations

import torch
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_stream_chunks import CHUNKS, _chunked, chunk_parts, logged_parts
from test_streaming import N_ITER, R_T, assert_same_runs
from test_streaming import _experiment as streamed_experiment
from test_streaming import _run as run_plan

# generation on the bf16 pool; every other call on the fp32 pool, so that every streamed chunk crosses the pool link
# into another dtype (and the actor, trained in fp32, crosses it to generate: home keeps its copy). Calls in bf16
# on another batch round as their kernels do for that batch, so a bf16 consumer or train step would equal the
# unstreamed run only within bf16's rounding; here only the generation computes in bf16, on the same rows.
GEN = ("cpu1", 1, 1, 1, 1)
PLACES = {"actor_gen": GEN, **{c: ("cpu0", 1, 1, 1, 1) for c in ("rew_inf", "ref_inf", "critic_inf", "actor_train",
                                                                  "critic_train")}}


def _experiment(tmp_path, kind: str):
    """test_streaming's PPO experiment on two pools: cpu0 computes in fp32, cpu1 is of ``kind``."""
    path = streamed_experiment(tmp_path, "ppo")
    one = '@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32,'
    text = path.read_text()
    assert one in text
    path.write_text(text.replace("import ResponseLengths, auto", "import Pool, ResponseLengths, auto")
                    .replace(one, f'@auto(pools=[Pool("cpu0", "cpu", 1), Pool("cpu1", {kind!r}, 1)], batch_size=32,'))
    return path


def _run(tmp_path, exp, name: str, tail: dict, iterations: int, gen_mbs: int):
    return run_plan(tmp_path, exp, name, tail, places={**PLACES, "actor_gen": GEN[:4] + (gen_mbs,)},
                    iterations=iterations)


def test_a_run_streamed_across_pools_matches_the_unstreamed_run_on_the_same_pools(tmp_path):
    """PPO on two pools (cpu0, cpu1; one kind, so that later iterations stay comparable: see the next test),
    generation on cpu1 streaming its finished rows in 3 chunks to inference on cpu0: each inference call runs
    once per chunk (the rows the EOS schedule ends between two split points) and once on the rest, and the run
    equals the unstreamed run on the same pools."""
    exp = _experiment(tmp_path, "cpu")
    chunked = _run(tmp_path, exp, "chunked", {"actor_gen": (R_T, 0, CHUNKS)}, N_ITER, 1)
    plain = _run(tmp_path, exp, "plain", {}, N_ITER, 1)
    calls = logged_parts(chunked / "logs" / "worker0.log")  # the fp32 pool's worker
    for t in range(N_ITER):
        want = chunk_parts(t)
        assert len(want) >= 3, want  # more than two parts crossed the pool link
        for c in ("rew_inf", "ref_inf", "critic_inf"):
            assert calls.get((t, c)) == want, (t, c)
    assert_same_runs(chunked, plain)


def test_micro_batches_streamed_from_a_bf16_pool_match_the_unstreamed_run(tmp_path):
    """Generation in bf16 (cpu-bf16) in 4 micro-batches one after another, each handed on as it ends to fp32
    inference on the other pool (``micro_batches=True``): each inference call runs on micro-batch 1, 2, 3 and then
    4, and the samples, metrics and whole checkpoint equal the unstreamed run's. One iteration: the next one's
    generation reads the actor cast to bf16, and a float-order difference of the fp32 training (the consumers'
    sums over parts) can flip a weight's bf16 rounding and so a sampled token."""
    from realloc.graph.tail import TailMigration

    exp = _experiment(tmp_path, "cpu-bf16")
    entry = TailMigration(rows=8, instances=0, chunks=3, micro_batches=True)
    streamed = _run(tmp_path, exp, "by_mb", {"actor_gen": entry}, 1, 4)
    plain = _run(tmp_path, exp, "plain", {}, 1, 4)
    calls = logged_parts(streamed / "logs" / "worker0.log")
    for c in ("rew_inf", "ref_inf", "critic_inf"):
        assert calls[0, c] == [list(range(lo, lo + 8)) for lo in (0, 8, 16, 24)], c
    assert_same_runs(streamed, plain, iterations=1)


def test_micro_batches_one_by_one_split_between_micro_batches_and_decode_the_plain_tokens(pool):
    """``SplitGeneration(one_by_one=True)`` at the thresholds of a micro-batch entry (4 micro-batches of 3 rows):
    each split point comes when a micro-batch ends, its chunk is that micro-batch's rows, and every token and
    log-prob is the plain generation's, bit for bit (lengths from a long-tailed EOS schedule)."""
    from realloc.estimator.mb_stream_cost import last_rows
    from realloc.graph.tail import split_thresholds
    from realloc.models.sampling import GenerationConfig

    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=(), temperature=0.9,
                               length_schedule=SCHEDULE)
    thresholds = split_thresholds(N_ROWS, last_rows(N_ROWS, 4), 3)
    plain, got, chunks, _ = next(r for r in pool.run(_chunked, gconfig, thresholds, 4, True) if r)
    assert chunks == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    for i, (tok, lp) in enumerate(plain):
        assert got[i][0] == tok and torch.equal(got[i][1], lp), i
