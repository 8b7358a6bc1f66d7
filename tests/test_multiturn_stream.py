"""Multi-turn rollouts streamed as they finish (issue 34 item 3; a stream-only ``tail`` entry on a multi-turn
GENERATE call, docs/multi-turn.md#streaming-finished-rollouts): the generation on device 0 hands the rollouts the
environment ended on to the reference's inference on device 1 in chunks, while the others keep taking turns. The
run equals the unstreamed one: rollouts token by token with their turns (where the loss mask is), rewards, metrics
and the whole checkpoint with the optimizer state; the reference ran once per chunk, on the rollouts the turn
counts say finished there."""

from __future__ import annotations

import re

import pytest

from realloc.graph.tail import split_thresholds

N_ROWS, R_T, CHUNKS, MAX_TURNS = 32, 4, 3, 4
EXPERIMENT = '''
import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto

# LengthEnv (tests/multiturn_cases.py): answers through the calculator tool in the sandbox; a turn of even length
# ends the rollout, so rollouts take 1 to 4 turns
ENV = {"env": "multiturn_cases:make_env", "env_args": {"turns": MAX_TURNS, "tool": True, "stop_even": True},
       "max_turns": MAX_TURNS, "turn_tokens": 6}


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=32)
@dataclasses.dataclass
class MultiTurnStreamed:
    seed: int = 1
    dataset: str = "REPO/experiments/data/calc_train.jsonl"
    tokenizer: str = "REPO/experiments/data/calc_tokenizer"
    sample_every: int = 1
    log_samples: int = 32  # every rollout
    balance_tokens: bool = BALANCE
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=1e-2, kl_coef=0.01)

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=4)
'''


def _experiment(tmp_path, balance: bool):
    from run_helpers import REPO

    path = tmp_path / f"multiturn_streamed_{int(balance)}.py"
    path.write_text(EXPERIMENT.replace("REPO", str(REPO)).replace("MAX_TURNS", str(MAX_TURNS))
                    .replace("BALANCE", str(balance)))
    return path


def _run(tmp_path, exp, name: str, tail: dict):
    """Generation on device 0, the reference's inference on device 1 (off the generation's mesh: it streams), the
    train step over both."""
    import os
    import subprocess
    import sys

    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from run_helpers import REPO
    from test_streaming import N_ITER

    graph = build_graph(load_experiment(str(exp)))
    places = {c: (("localhost", 2, 1, 1, 1) if graph.call(c).is_train else ("localhost:0", 1, 1, 1, 1)
                  if c == "actor_gen" else ("localhost:1", 1, 1, 1, 1)) for c in graph.spec.call_names}
    plan = tmp_path / f"{name}.json"
    ExecutionPlan.by_hand(graph, places, source="hand", tail=tail).save(plan)
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet", "--plan",
           str(plan), "--iterations", str(N_ITER)]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


def _turns(sample: dict) -> int:
    """A logged rollout's policy turns: its segments alternate observation, turn, observation, ..."""
    return sum(1 for i, n in enumerate(sample["turn_segments"]) if i % 2 == 1 and n > 0)


def _expected_parts(samples: list[dict], iteration: int) -> list[list[int]]:
    """The rows of each chunk and of the rest, from the rollouts' turn counts: split point j is the first turn after
    which at most split_thresholds(...)[j] rollouts are running (a rollout of t turns runs until turn t ends)."""
    turns = {s["seq"]: _turns(s) for s in samples if s["iteration"] == iteration}
    assert sorted(turns) == list(range(N_ROWS))
    parts, prev = [], 0
    for th in split_thresholds(N_ROWS, R_T, CHUNKS):
        k = min(k for k in range(1, MAX_TURNS + 1) if sum(t > k for t in turns.values()) <= th)
        parts.append([i for i in range(N_ROWS) if prev < turns[i] <= max(k, prev)])
        prev = max(k, prev)
    parts.append([i for i in range(N_ROWS) if turns[i] > prev])
    return [p for p in parts if p]


def _compare_call_stats(streamed, plain) -> None:
    """The generation's own stats (turns, tokens, tool calls, rewards) summed over the streamed parts equal the
    plain call's; seconds aside."""
    from test_runtime_e2e import metrics

    for a, b in zip(metrics(streamed), metrics(plain), strict=True):
        got, want = a["calls"]["actor_gen"], b["calls"]["actor_gen"]
        counts = {k for k in want if not k.endswith("_s") and k not in ("time", "start", "end")}
        assert {"turns", "policy_tokens", "env_tokens", "tool_ok", "prefill_tokens"} <= counts
        for k in counts:
            assert got[k] == pytest.approx(want[k], rel=1e-6), k


@pytest.mark.parametrize("balance", [False, True])
def test_a_multiturn_run_streamed_in_chunks_matches_the_unstreamed_run(tmp_path, balance):
    import json

    from test_streaming import N_ITER, assert_same_runs

    exp = _experiment(tmp_path, balance)
    streamed = _run(tmp_path, exp, "streamed", {"actor_gen": (R_T, 0, CHUNKS)})
    plain = _run(tmp_path, exp, "plain", {})
    samples = [json.loads(x) for x in (plain / "samples.jsonl").read_text().splitlines()]
    calls: dict[tuple[int, str], list[list[int]]] = {}
    for line in (streamed / "logs" / "worker1.log").read_text().splitlines():
        m = re.search(r"iteration (\d+) call (ref_inf) rows (\[\[.*\]\])", line)  # a part's rows
        if m:
            calls.setdefault((int(m.group(1)) - 1, m.group(2)), []).append(json.loads(m.group(3))[0])
    streamed_parts = 0
    for t in range(N_ITER):
        want = _expected_parts(samples, t + 1)  # samples.jsonl counts iterations from 1
        assert calls[t, "ref_inf"] == want, t  # one part per non-empty chunk and the rest, as the turns say
        streamed_parts += len(want)
    assert streamed_parts > N_ITER  # the reference ran in more than one part: a comparison that can fail
    assert len({_turns(s) for s in samples}) > 1  # rollouts of different turn counts
    assert_same_runs(streamed, plain)
    _compare_call_stats(streamed, plain)
