"""Start-up and per-iteration overhead (docs/speed.md): the breakdown's arithmetic, the overhead split of an
iteration, the converged search, the early-started worker's arguments, and what the master and workers import.
The timing claims themselves are benchmarks (benchmarks/bench_runtime.py, bench_vs_trl.py), not tests."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.runtime.records.overhead import iteration_overheads, union_seconds
from realloc.runtime.records.startup import ARGS_FROM_STDIN, StartupClock, WorkerStart, worker_argv
from realloc.search.engine import CONVERGED_EVALS, converged

REPO = Path(__file__).resolve().parents[1]


def test_startup_report_is_consecutive_phases_from_launch_and_the_slowest_workers_imports():
    clock = StartupClock(launched=100.0, marks={"imports": 101.0, "experiment": 101.5, "search": 102.0,
                                                "master": 102.25, "workers": 106.0, "setup": 106.5,
                                                "first_call": 106.75})
    clock.workers = {0: WorkerStart(0, started=100.5, imported=104.0, ready=104.0),
                     1: WorkerStart(1, started=100.6, imported=105.1, ready=105.2)}
    r = clock.report()
    assert r["total_s"] == 6.75 and r["first_call"] == 106.75
    assert r["phases_s"] == {"imports": 1.0, "experiment": 0.5, "search": 0.5, "master": 0.25, "workers": 3.75,
                             "setup": 0.5, "first_call": 0.25}
    # worker 1 imported for 4.5 s (the slowest); worker 0 waited 0 s, worker 1 0.1 s for its arguments
    assert r["workers"] == {"started_s": 0.5, "imports_s": 4.5, "slowest": 1, "waited_s": 0.1}
    line = clock.line()
    assert line.startswith("start-up 6.8 s to the first call: master imports 1.0 s") and "(slowest worker 1)" in line


def test_startup_report_leaves_out_phases_a_run_did_not_reach_and_marks_once():
    clock = StartupClock(launched=10.0)
    clock.marks = {"imports": 11.0, "search": 13.0}
    clock.mark("imports")  # a second mark of a phase keeps the first
    assert clock.report()["phases_s"] == {"imports": 1.0, "search": 2.0}
    assert clock.report()["total_s"] == 3.0 and "workers" not in clock.report()


def test_union_seconds_against_a_brute_force_count():
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.75), (7.0, 7.0)]
    grid = [i / 1000 for i in range(8000)]
    brute = sum(1 for x in grid if any(s <= x < e for s, e in spans)) / 1000
    assert union_seconds(spans) == pytest.approx(brute, abs=2e-3) and union_seconds(spans) == pytest.approx(4.0)


def _rec(kind: str, t: int, spans: dict[str, tuple[float, float]], dispatched: float, received: float) -> dict:
    return {"kind": kind, "iteration": t, "dispatched": dispatched, "spans": spans,
            "received": {r: received for r in spans}}


def test_iteration_overhead_splits_a_hand_made_window():
    """Iteration 1: gen on both ranks 0.0-1.0 (rank 1 ends at 0.8), a data transfer 1.1-1.2, train 1.3-2.0, the
    reply in at 2.05. Iteration 2: gen 2.1-2.5, an eval pass of iteration 1 on rank 0 2.3-2.7, train 2.8-3.0."""
    records = [_rec("setup", 0, {"0": (-1.0, -0.5)}, -1.0, -0.4),
               _rec("call", 1, {"0": (0.0, 1.0), "1": (0.0, 0.8)}, 0.0, 1.02),
               _rec("data", 1, {"0": (1.1, 1.2), "1": (1.1, 1.2)}, 1.05, 1.21),
               _rec("call", 1, {"0": (1.3, 2.0), "1": (1.3, 2.0)}, 1.25, 2.05),
               _rec("eval", 1, {"0": (2.3, 2.7)}, 2.05, 2.71),
               _rec("call", 2, {"0": (2.1, 2.5), "1": (2.1, 2.5)}, 2.06, 2.52),
               _rec("call", 2, {"0": (2.8, 3.0), "1": (2.8, 3.0)}, 2.75, 3.05)]
    one, two = iteration_overheads(records)
    assert (one.iteration, two.iteration) == (1, 2)
    assert one.window == pytest.approx(2.05) and one.compute == pytest.approx(1.7)
    assert one.eval == 0 and one.moves == pytest.approx(0.1) and one.master == pytest.approx(0.25)
    # window 2.05..3.05: compute 2.1-2.5 and 2.8-3.0; the eval pass outside it 2.5-2.7; the rest 0.4 s
    assert two.window == pytest.approx(1.0) and two.compute == pytest.approx(0.6)
    assert two.eval == pytest.approx(0.2) and two.moves == 0 and two.master == pytest.approx(0.2)
    assert two.overhead == pytest.approx(0.4)


def test_converged_waits_for_the_larger_of_a_floor_and_twice_the_evaluations_to_the_best():
    assert not converged(CONVERGED_EVALS - 1, 0) and converged(CONVERGED_EVALS, 0)
    assert not converged(CONVERGED_EVALS + 5_000, 5_000 + 1) and converged(CONVERGED_EVALS + 5_000, 5_000)
    assert not converged(3 * 10**6 - 1, 10**6) and converged(3 * 10**6, 10**6)


def test_a_converging_search_stops_early_with_the_plan_a_long_fixed_budget_finds():
    """The demo's plan space: best after a few thousand evaluations; with no time given the search stops well
    before its limit, at the cost of a deterministic search 5x longer than the convergence floor."""
    from realloc.search.planner import plan_search

    exp = str(REPO / "experiments" / "arith_grpo.py")
    fast = plan_search(exp, 60.0, converge=True)
    ref = plan_search(exp, None, max_evals=5 * CONVERGED_EVALS)
    assert fast.stats.seconds < 30 and fast.stats.evals < ref.stats.evals
    assert fast.evaluation["cost"] == pytest.approx(ref.evaluation["cost"], rel=1e-9)


def test_an_early_started_worker_reads_its_arguments_from_stdin_and_exits_when_it_closes(monkeypatch):
    assert worker_argv(["--rank", "0"]) == ["--rank", "0"]  # arguments on the command line: as they are
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(["--rank", "1", "--set", "a=b c"]) + "\n"))
    assert worker_argv([ARGS_FROM_STDIN]) == ["--rank", "1", "--set", "a=b c"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # the master stopped before sending them
    assert worker_argv([ARGS_FROM_STDIN]) is None


def test_the_master_plans_without_torch_and_workers_load_megatron_without_dynamo_or_wandb(tmp_path):
    """What `realloc run`'s master imports before its workers start (the CLI, the run command, the experiment
    and its graph) is torch-free; a worker's megatron-core import leaves torch.compile and wandb as they were."""
    script = (
        "import sys, torch\n"
        "compile_fn = torch.compile\n"
        "import realloc.runtime.control.worker\n"
        "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules, 'wandb_blocked': 'wandb' in sys.modules and "
        "sys.modules['wandb'] is None, 'compile': torch.compile is compile_fn}))\n")
    master = (
        "import sys, json\n"
        "import realloc.cli, realloc.runtime.run_cli\n"
        "from realloc.overrides import load_with_overrides\n"
        "from realloc.graph.dataflow import build_graph\n"
        f"build_graph(load_with_overrides({str(REPO / 'experiments' / 'arith_grpo.py')!r}, ()))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", master + script.replace("import sys, torch", "import torch")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert lines[0] == {"torch": False}
    assert lines[1] == {"dynamo": False, "wandb_blocked": False, "compile": True}


@pytest.mark.parametrize("which", ["tiny_bpe"])
def test_a_generic_fast_tokenizer_loads_as_autotokenizer_would_load_it(which, hf_assets):
    """The start-up shortcut (data/tokenizer.py): a directory naming transformers' generic fast class loads through
    it directly; the result is what AutoTokenizer gives: class, vocabulary, special tokens, ids with and without
    special tokens, the chat template's rendering and decoding. (A plain directory without a chat template, like
    the demo's ``arith_tokenizer``, now loads with the tokenizers library alone: tests/test_light_tokenizer.py
    compares that one with transformers.)"""
    from transformers import AutoTokenizer

    from realloc.data.tokenizer import Tokenizer

    path = REPO / "experiments" / "data" / "arith_tokenizer" if which == "arith" else hf_assets.tokenizer
    ours, ref = Tokenizer.load(path)._hf, AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(ours) is type(ref) and ours.get_vocab() == ref.get_vocab()
    assert ours.special_tokens_map == ref.special_tokens_map and ours.chat_template == ref.chat_template
    texts = ["1+63=", "45-38=007", "What is 2 + 3?", ""]
    for special in (True, False):
        assert ours(texts, add_special_tokens=special)["input_ids"] == ref(texts, add_special_tokens=special)["input_ids"]
    ids = ref("12+30=42")["input_ids"]
    assert ours.decode(ids) == ref.decode(ids) and ours.decode(ids, skip_special_tokens=True) == ref.decode(
        ids, skip_special_tokens=True)
    if ref.chat_template:
        chat = [{"role": "user", "content": "Hi there"}]
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
