"""Streaming without migration in a run (issue 31 item 2; a ``tail`` entry with instances=0,
docs/tail-semantics.md): the generation on device 0 hands the rows finished at the split point to the inference
calls on device 1, which run on them while it decodes the rest; the run equals the unstreamed one (samples,
metrics, the whole checkpoint with optimizer state), for PPO and GRPO."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from realloc.lengths import ResponseLengths
from realloc.models.length_schedule import scheduled_lengths
from test_streaming import N_ITER, R_T, _checkpoint, _experiment, _samples


def _run(tmp_path, exp, name: str, tail: dict):
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from test_runtime_e2e import env

    graph = build_graph(load_experiment(str(exp)))
    # disaggregated: generation on device 0, the inference calls on device 1, the train steps over both
    places = {c: (("localhost", 2, 1, 1, 1) if graph.call(c).is_train else
                  ("localhost:0", 1, 1, 1, 1) if c == "actor_gen" else ("localhost:1", 1, 1, 1, 1))
              for c in graph.spec.call_names}
    plan = tmp_path / f"{name}.json"
    ExecutionPlan.by_hand(graph, places, source="hand", tail=tail).save(plan)
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet", "--plan",
           str(plan), "--iterations", str(N_ITER)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_streamed_run_matches_the_unstreamed_run(tmp_path, algo):
    from realloc.models.weights import param_seed
    from test_runtime_e2e import metrics

    exp = _experiment(tmp_path, algo)
    n = 32  # PPO: 32 prompts; GRPO: 8 prompts, 4 samples each
    streamed = _run(tmp_path, exp, "streamed", {"actor_gen": (R_T, 0)})
    plain = _run(tmp_path, exp, "plain", {})
    # the inference calls ran twice per iteration: on the rows finished at the split point (the first step after
    # which at most R_T rows run), then on the rest; the generation on device 0 took two requests
    calls = {}
    for line in (streamed / "logs" / "worker1.log").read_text().splitlines():
        m = re.search(r"iteration (\d+) call (\w+) rows (\[.*\])", line)
        if m:
            calls.setdefault((int(m.group(1)) - 1, m.group(2)), []).append(eval(m.group(3))[0])  # noqa: S307
    inference = [c for c in ("rew_inf", "ref_inf", "critic_inf") if c in {k[1] for k in calls}]
    assert len(inference) >= 2
    for t in range(N_ITER):
        lengths = scheduled_lengths(ResponseLengths.lognormal(median=2, p99=14), 16,
                                    param_seed(1, f"generate/{t}"), range(n))
        step = min(s for s in range(16) if sum(k > s + 1 for k in lengths) <= R_T)
        part1 = [i for i, k in enumerate(lengths) if k <= step + 1]
        assert 0 < n - len(part1) <= R_T
        for c in inference:
            assert calls[t, c] == [part1, [i for i in range(n) if i not in part1]], (t, c)
    gen_rows = [m.group(1) for m in re.finditer(r"iteration \d+ call actor_gen rows (\[.*\])",
                                                (streamed / "logs" / "worker0.log").read_text())]
    assert len(gen_rows) == N_ITER  # the second request of each iteration names its running rows
    # the same samples, rewards, losses, and final parameters and optimizer state
    for a, b in zip(metrics(streamed), metrics(plain), strict=True):
        for k, v in b.items():
            if isinstance(v, float) and k not in ("time", "iteration_time") and not k.endswith("_s"):
                assert a[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    got, want = _samples(streamed), _samples(plain)
    assert got.keys() == want.keys() and len(want) >= n * N_ITER
    for k, s in want.items():
        for f, v in s.items():
            if f in ("logp", "reward"):
                assert got[k][f] == pytest.approx(v, abs=1e-6)
            else:
                assert got[k][f] == v, (k, f)
    a, b = _checkpoint(streamed), _checkpoint(plain)
    assert a.keys() == b.keys() and a
    for k in b:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-6), k
