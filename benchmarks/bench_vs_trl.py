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
import threading
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


class TreeCPU:
    """CPU seconds (user + system) of a process and all its descendants, sampled every ``every`` seconds from
    Linux's /proc while it runs: realloc's master and workers, or TRL's one process. On this shared machine wall
    times depend on the other processes' load; CPU seconds much less."""

    def __init__(self, proc: subprocess.Popen, every: float = 0.1) -> None:
        self.proc, self.every = proc, every
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds of the tree so far)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.seen: dict[int, float] = {}  # pid -> its last CPU reading (a finished worker keeps its share)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _cpu(self, pid: int) -> float:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / self.tick

    def _tree(self) -> list[int]:
        """The root and its descendants, from each thread's children list (cheaper than scanning /proc)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                try:
                    todo += [int(c) for c in task.read_text().split()]
                except (OSError, ValueError):
                    pass
        return out

    def _run(self) -> None:
        while self.proc.poll() is None:
            for pid in self._tree():
                try:
                    self.seen[pid] = self._cpu(pid)
                except (OSError, ValueError, IndexError):
                    pass  # ended meanwhile: its last reading stays
            self.samples.append((time.time(), sum(self.seen.values())))
            time.sleep(self.every)

    def at(self, t: float) -> float:
        """The tree's CPU seconds at time ``t`` (linear between samples)."""
        self.thread.join()
        s = self.samples
        for (t0, c0), (t1, c1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
        return s[-1][1] if s and t > s[-1][0] else 0.0


def timed_run(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, TreeCPU, float]:
    """Run ``cmd`` to its end while sampling its process tree's CPU; returns the result, the sampler and the CPU
    seconds of the whole run (every process it waited for, from the kernel's own count)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cpu = TreeCPU(proc)
    out, err = proc.communicate()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), cpu, total


def cpu_between(cpu: TreeCPU, ends: list[float]) -> float:
    """Median CPU seconds per iteration between consecutive iteration ends (iterations 2..N)."""
    per = [cpu.at(b) - cpu.at(a) for a, b in zip(ends, ends[1:])]
    return statistics.median(per) if per else float("nan")


def accuracy(checkpoint: Path) -> float:
    from realloc.demo.accuracy import exact_match_accuracy

    return exact_match_accuracy(checkpoint, EVAL, max_new_tokens=4).accuracy


def run_realloc(iterations: int, base: Path) -> dict:
    run_dir = base / "realloc"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(EXPERIMENT), "--iterations", str(iterations),
           "--save-every", str(iterations), "--run-dir", str(run_dir), "--quiet", "--set", "eval.every=0"]
    t0 = time.time()
    r, cpu, total = timed_run(cmd, {**os.environ, "TMPDIR": str(base)})
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    records = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    first = min(x["dispatched"] for x in records if x["kind"] == "call")
    ends = sorted(x["completed"] for x in records if x["kind"] == "call" and x["label"] == "actor_train")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = run_dir / "actor-hf"
    subprocess.run([sys.executable, "-m", "realloc.cli", "export", str(run_dir), "--model", "actor", "--out", str(out)],
                   check=True, capture_output=True, env={**os.environ, "TMPDIR": str(base)})
    return {"startup": first - t0, "s_per_it": statistics.median(m["iteration_time"] for m in metrics[1:]),
            "accuracy": accuracy(out), "cpu_startup": cpu.at(first), "cpu_per_it": cpu_between(cpu, ends),
            "cpu_total": total}


def run_trl(py: str, iterations: int, threads: int, base: Path) -> dict:
    out = base / f"trl{threads}"
    shutil.rmtree(out, ignore_errors=True)
    report = base / f"trl{threads}.json"
    cmd = [py, str(TRL_SCRIPT), "--checkpoint", str(CHECKPOINT), "--train", str(TRAIN), "--out", str(out),
           "--report", str(report), "--iterations", str(iterations), "--threads", str(threads)]
    t0 = time.time()
    r, cpu, total = timed_run(cmd, {**os.environ, "TMPDIR": str(base)})
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    rep = json.loads(report.read_text())
    ends = rep["step_ends"][STEPS_PER_ITERATION - 1::STEPS_PER_ITERATION]  # each iteration's last step
    its = [b - a for a, b in zip(ends, ends[1:])]
    return {"startup": rep["first_call"] - t0, "s_per_it": statistics.median(its) if its else float("nan"),
            "accuracy": accuracy(Path(rep["checkpoint"])), "cpu_startup": cpu.at(rep["first_call"]),
            "cpu_per_it": cpu_between(cpu, ends), "cpu_total": total}


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
                detail = res.get("error") or (f"start-up {res['startup']:.1f} s ({res['cpu_startup']:.1f} CPU s), "
                                              f"{res['s_per_it']:.3f} s/iteration ({res['cpu_per_it']:.3f} CPU s), "
                                              f"held-out exact match {res['accuracy']:.1%}, "
                                              f"{res['cpu_total']:.1f} CPU s in all")
                print(f"round {pair + 1} {name}: {detail} (load average {load:.1f})", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\ndemo GRPO stage, {args.iterations} iterations (32 prompts x 8 samples, 4 new tokens), {args.pairs} "
          f"interleaved rounds; range over the rounds")
    ok = {k: [r for r in v if "error" not in r] for k, v in results.items()}
    header = (f"{'':<20}{'start-up s':>16}{'CPU s':>12}{'s/iteration':>18}{'CPU s/it':>14}{'held-out EM':>16}"
              f"{'CPU s, run':>14}")
    print(header)
    print("-" * len(header))
    for name, rs in ok.items():
        if not rs:
            print(f"{name:<20} failed: {results[name][0]['error']}")
            continue

        def span(key: str, fmt: str) -> str:
            lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
            return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"

        print(f"{name:<20}{span('startup', '.1f'):>16}{span('cpu_startup', '.1f'):>12}{span('s_per_it', '.3f'):>18}"
              f"{span('cpu_per_it', '.3f'):>14}{span('accuracy', '.1%'):>16}{span('cpu_total', '.1f'):>14}")
    mine = ok.get("realloc")
    for name, rs in ok.items():
        if name != "realloc" and rs and mine:
            def ratio(key: str) -> str:
                return f"{statistics.median(r[key] for r in mine) / statistics.median(r[key] for r in rs):.2f}x"

            print(f"realloc / {name}: s/iteration {ratio('s_per_it')} (CPU {ratio('cpu_per_it')}), start-up "
                  f"{ratio('startup')} (CPU {ratio('cpu_startup')}), CPU of the whole run {ratio('cpu_total')} "
                  f"(medians)")


if __name__ == "__main__":
    main()
