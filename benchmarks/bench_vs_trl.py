"""realloc beside TRL on the demo's GRPO stage: start-up, time per iteration and held-out accuracy, interleaved.

    .venv/bin/python benchmarks/bench_vs_trl.py [--iterations 40] [--pairs 2] [--trl-threads 2,1]
        [--trl-python .venv-trl/bin/python]

realloc runs ``experiments/arith_grpo.py`` (what ``make demo`` trains; its in-run evaluation off, as TRL does none)
with ``realloc run``; TRL 1.16's ``GRPOTrainer`` runs ``benchmarks/trl_grpo_arith.py`` with the same checkpoint
(``experiments/data/arith_sft``), prompts, reward and settings, in its own environment so that the project's pins
stay as they are. Make that environment once (torch pinned in the same command, or pip pulls a CUDA build):

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 transformers==5.23.0

Without it (or without ``--trl-python``/``$REALLOC_TRL_PYTHON``) the benchmark says so and measures realloc only.
The runs alternate (realloc, TRL with each thread count, then the other way round) so that a change in the
machine's load touches both. Per run:

- start-up: from launching the command to its first generation (realloc: the first call's dispatch; TRL: its first
  ``_generate``), both measured by this script's clock;
- s/iteration: the median over iterations 2..N (an iteration: 256 samples and two optimizer steps);
- held-out exact match: the trained model, exported as an HF checkpoint, decoded greedily with transformers on
  the 500 held-out prompts (``realloc.demo.accuracy``: the same check for both).

It is a benchmark, not a test: its numbers depend on the machine and its load (``docs/speed.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXPERIMENT = REPO / "experiments" / "arith_grpo.py"
CHECKPOINT = REPO / "experiments" / "data" / "arith_sft"
TRAIN = REPO / "experiments" / "data" / "arith_train.jsonl"
EVAL = REPO / "experiments" / "data" / "arith_eval.jsonl"
TRL_SCRIPT = REPO / "benchmarks" / "trl_grpo_arith.py"
TRL_ENV = "REALLOC_TRL_PYTHON"
STEPS_PER_ITERATION = 2


def trl_python(given: str | None) -> tuple[str | None, str]:
    """The interpreter of TRL's environment and a line saying what was found."""
    candidates = [given, os.environ.get(TRL_ENV), str(REPO / ".venv-trl" / "bin" / "python")]
    for py in (c for c in candidates if c):
        if not Path(py).is_file():
            if py == given:
                return None, f"--trl-python {py}: no such file"
            continue
        r = subprocess.run([py, "-c", "import trl, torch; print(trl.__version__, torch.__version__)"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return py, f"TRL {r.stdout.split()[0]} (torch {r.stdout.split()[1]}) from {py}"
        return None, f"{py} cannot import trl ({(r.stderr.strip().splitlines() or ['?'])[-1]})"
    return None, ("TRL is not installed: make its environment with `python3 -m venv .venv-trl && .venv-trl/bin/pip "
                  "install torch==2.13.0 trl==1.16.0 transformers==5.23.0` (or pass --trl-python); measuring "
                  "realloc only")


def accuracy(checkpoint: Path) -> float:
    from realloc.demo.accuracy import exact_match_accuracy

    return exact_match_accuracy(checkpoint, EVAL, max_new_tokens=4).accuracy


def run_realloc(iterations: int, base: Path) -> dict:
    run_dir = base / "realloc"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(EXPERIMENT), "--iterations", str(iterations),
           "--save-every", str(iterations), "--run-dir", str(run_dir), "--quiet", "--set", "eval.every=0"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(base)})
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    records = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    first = min(x["dispatched"] for x in records if x["kind"] == "call")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = run_dir / "actor-hf"
    subprocess.run([sys.executable, "-m", "realloc.cli", "export", str(run_dir), "--model", "actor", "--out", str(out)],
                   check=True, capture_output=True, env={**os.environ, "TMPDIR": str(base)})
    return {"startup": first - t0, "s_per_it": statistics.median(m["iteration_time"] for m in metrics[1:]),
            "accuracy": accuracy(out)}


def run_trl(py: str, iterations: int, threads: int, base: Path) -> dict:
    out = base / f"trl{threads}"
    shutil.rmtree(out, ignore_errors=True)
    report = base / f"trl{threads}.json"
    cmd = [py, str(TRL_SCRIPT), "--checkpoint", str(CHECKPOINT), "--train", str(TRAIN), "--out", str(out),
           "--report", str(report), "--iterations", str(iterations), "--threads", str(threads)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(base)})
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    rep = json.loads(report.read_text())
    ends = rep["step_ends"][STEPS_PER_ITERATION - 1::STEPS_PER_ITERATION]  # each iteration's last step
    its = [b - a for a, b in zip(ends, ends[1:])]
    return {"startup": rep["first_call"] - t0, "s_per_it": statistics.median(its) if its else float("nan"),
            "accuracy": accuracy(Path(rep["checkpoint"]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--pairs", type=int, default=2, help="rounds of (realloc, TRL per thread count), alternating")
    p.add_argument("--trl-threads", default="2", help="torch threads of TRL's runs, comma-separated (e.g. 2,1)")
    p.add_argument("--trl-python", default=None, help=f"TRL's environment's python (default ${TRL_ENV}, then "
                   ".venv-trl/bin/python)")
    args = p.parse_args()
    py, found = trl_python(args.trl_python)
    print(found, flush=True)
    jobs = [("realloc", None)] + ([(f"TRL, {n} thread{'s' * (n > 1)}", n) for n in
                                  (int(x) for x in args.trl_threads.split(","))] if py else [])
    base = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    results: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    try:
        for pair in range(args.pairs):
            for name, threads in (jobs if pair % 2 == 0 else jobs[::-1]):
                load = os.getloadavg()[0]
                res = run_realloc(args.iterations, base) if threads is None else run_trl(py, args.iterations,
                                                                                         threads, base)
                results[name].append(res)
                detail = res.get("error") or (f"start-up {res['startup']:.1f} s, {res['s_per_it']:.3f} s/iteration, "
                                              f"held-out exact match {res['accuracy']:.1%}")
                print(f"round {pair + 1} {name}: {detail} (load average {load:.1f})", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\ndemo GRPO stage, {args.iterations} iterations (32 prompts x 8 samples, 4 new tokens), {args.pairs} "
          f"interleaved rounds; range over the rounds")
    ok = {k: [r for r in v if "error" not in r] for k, v in results.items()}
    header = f"{'':<20}{'start-up s':>16}{'s/iteration':>18}{'held-out EM':>16}"
    print(header)
    print("-" * len(header))
    for name, rs in ok.items():
        if not rs:
            print(f"{name:<20} failed: {results[name][0]['error']}")
            continue

        def span(key: str, fmt: str) -> str:
            lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
            return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"

        print(f"{name:<20}{span('startup', '.1f'):>16}{span('s_per_it', '.3f'):>18}{span('accuracy', '.1%'):>16}")
    mine = ok.get("realloc")
    for name, rs in ok.items():
        if name != "realloc" and rs and mine:
            print(f"realloc / {name}: s/iteration {statistics.median(r['s_per_it'] for r in mine) / statistics.median(r['s_per_it'] for r in rs):.2f}x, "
                  f"start-up {statistics.median(r['startup'] for r in mine) / statistics.median(r['startup'] for r in rs):.2f}x (medians)")


if __name__ == "__main__":
    main()
