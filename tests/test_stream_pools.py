"""Streaming across pools (issue 32; docs/heterogeneous.md, "Streaming across pools"): a generation on one pool
hands its finished rows in chunks to inference on a pool of another kind and dtype; the run equals the unstreamed
run on the same two pools (samples, metrics, the whole checkpoint with optimizer state)."""

from __future__ import annotations

import subprocess
import sys

from test_stream_chunks import CHUNKS, chunk_parts, logged_parts
from test_streaming import EXPERIMENTS, LONG_TAIL, N_ITER, R_T, assert_same_runs

# test_streaming's experiment on two pools of two kinds: cpu0 computes in fp32, cpu1 in bf16
TWO_POOLS = '''
import dataclasses
import importlib.util

from realloc.api import Pool, ResponseLengths, auto
IMPORT

_spec = importlib.util.spec_from_file_location("base", BASE)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


@auto(pools=[Pool("cpu0", "cpu", 1), Pool("cpu1", KIND, 1)], batch_size=32, prompt_len=8, gen_len=16)
@dataclasses.dataclass
class StreamedPools(_base.CLASS):
    dataset: str = DATASET
    FIELD: object = SETTINGS
    sample_every: int = 1
    log_samples: int = 32
'''
# generation on the bf16 pool; every other call on the fp32 pool, so that every streamed chunk crosses the pool link
# into another dtype (and the actor, trained in fp32, crosses it to generate: home keeps its copy). Calls in bf16
# on another batch round as their kernels do for that batch, so a bf16 consumer or train step would equal the
# unstreamed run only within bf16's rounding; here only the generation computes in bf16, on the same rows.
GEN = ("cpu1", 1, 1, 1, 1)
PLACES = {"actor_gen": GEN, **{c: ("cpu0", 1, 1, 1, 1) for c in ("rew_inf", "ref_inf", "critic_inf", "actor_train",
                                                                  "critic_train")}}


def _experiment(tmp_path, kind: str = "cpu-bf16"):
    from run_helpers import REPO

    base, cls, field, settings, imp = EXPERIMENTS["ppo"]
    text = (TWO_POOLS.replace("IMPORT", imp).replace("BASE", repr(str(REPO / "experiments" / base)))
            .replace("CLASS", cls).replace("FIELD", field).replace("SETTINGS", settings.replace("SCHEDULE", LONG_TAIL))
            .replace("DATASET", repr(str(REPO / "experiments/data/ppo_tiny_prompts.jsonl"))).replace("KIND", repr(kind)))
    path = tmp_path / "streamed_pools.py"
    path.write_text(text)
    return path


def _run(tmp_path, exp, name: str, tail: dict, iterations: int, gen_mbs: int):
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from test_runtime_e2e import env

    graph = build_graph(load_experiment(str(exp)))
    plan = tmp_path / f"{name}.json"
    places = {**PLACES, "actor_gen": GEN[:4] + (gen_mbs,)}
    ExecutionPlan.by_hand(graph, places, source="hand", tail=tail).save(plan)
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet", "--plan",
           str(plan), "--iterations", str(iterations)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


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
