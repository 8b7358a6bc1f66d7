"""The arithmetic demo (``make demo``): SFT a tiny LLaMA through realloc, then GRPO with an exact-match reward.

    python -m realloc.demo.arith_demo                 # what `make demo` runs (from the shipped SFT checkpoint)
    python -m realloc.demo.arith_demo --rebuild-sft   # train the SFT stage again first, and start from that
    python -m realloc.demo.arith_demo sft [--out DIR] # only the SFT stage (default DIR experiments/data/arith/sft)
    python -m realloc.demo.arith_demo init [--out DIR] # the random model the SFT stage starts from (shipped in
                                                       # experiments/data/arith_init; this makes it again)

The demo runs from a source checkout (``git clone``, then ``make demo``): its experiments and data files live in
the repository's ``experiments/`` folder, which an installed wheel does not carry; from a wheel it says so.

1. **SFT stage** (shipped in ``experiments/data/arith_sft``, 0.8 MB; made by the ``sft`` stage, about
   100 s on 2 cores): a random 4-layer LLaMA (``init``, shipped in ``experiments/data/arith_init``) carrying
   the task's shipped character tokenizer
   (``experiments/data/arith_tokenizer``), then ``realloc run experiments/arith_sft.py`` and
   ``realloc export``. Its data,
   ``arith_sft_padded.jsonl``, writes three quarters of the answers zero-padded to three digits
   ("45-38=007"), as a fixed-width source prints them; the grader reads "007" as another number than "7".
   The SFT model learns the arithmetic and copies the habit.
2. **Before**: exact-match accuracy of the SFT checkpoint on the 500 held-out prompts, greedy, with
   transformers (``realloc.demo.accuracy``: an independent check, not realloc's generation).
3. **GRPO**: ``realloc run experiments/arith_grpo.py`` on the local 2-device CPU cluster with a
   searched plan, 8 responses per prompt and the ``exact_match`` verifiable reward; metrics.jsonl
   carries the greedy accuracy on 256 held-out prompts every few iterations (``eval``).
4. **After**: ``realloc export`` of the trained actor and the same accuracy check.

Every stage is seeded: a rerun prints the same numbers up to float rounding between plans.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from realloc.demo.demo_assets import build_once
from realloc.runtime.records.run_claim import clear_run_dir

if TYPE_CHECKING:
    from realloc.demo.accuracy import Accuracy

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "experiments" / "data" / "arith"  # built assets (gitignored)
# The SFT stage's checkpoint as shipped: `python -m realloc.demo.arith_demo sft --out experiments/data/arith_sft`
# re-makes it (the same held-out accuracy; tests/test_arith_demo.py checks the shipped one).
SHIPPED_SFT = REPO / "experiments" / "data" / "arith_sft"
# Shipped: `python -m realloc.demo.arith_task tokenizer --out experiments/data/arith_tokenizer` re-makes it.
TOKENIZER = REPO / "experiments" / "data" / "arith_tokenizer"
# The random model arith_sft.py starts from, as shipped: `python -m realloc.demo.arith_demo init --out DIR` makes
# it again (seeded: the same weights; tests/test_arith_demo.py compares them).
SHIPPED_INIT = REPO / "experiments" / "data" / "arith_init"
SFT_EXPERIMENT = REPO / "experiments" / "arith_sft.py"
GRPO_EXPERIMENT = REPO / "experiments" / "arith_grpo.py"
EVAL_PROMPTS = REPO / "experiments" / "data" / "arith_eval.jsonl"
# A 4-layer LLaMA of width 64 (0.2M parameters); its vocabulary of 32 pads the tokenizer's 18 ids so that
# tp=2 divides it. HF's initializer range: the model trains from scratch.
MODEL = dict(arch="llama", vocab_size=32, hidden=64, layers=4, heads=4, kv_heads=4, intermediate=176, seed=0,
             init_std=0.02, max_position_embeddings=32)
MAX_NEW_TOKENS = 4  # three digits and EOS


def init_checkpoint(root: Path = ROOT, target: Path | None = None) -> Path:
    """The random LLaMA the SFT stage starts from, built once into ``target`` (default ``root/init``; a second)."""
    from transformers.utils import logging as hf_logging

    from realloc.tiny_assets.hf import make_tiny_checkpoint

    hf_logging.disable_progress_bar()
    target = target or root / "init"
    target.parent.mkdir(parents=True, exist_ok=True)
    return build_once(target, lambda d: make_tiny_checkpoint(d, tokenizer_dir=TOKENIZER, **MODEL))


def check_source_tree() -> None:
    """One error when the demo's files are not there: it runs from a source checkout, not from a wheel."""
    missing = [p for p in (SFT_EXPERIMENT, GRPO_EXPERIMENT, TOKENIZER, EVAL_PROMPTS) if not p.exists()]
    if missing:
        raise ValueError(f"the arithmetic demo runs from a source checkout of realloc (git clone, then `make demo`): "
                         f"its experiments and data are in the repository's experiments/ folder, which the installed "
                         f"package does not carry ({missing[0]} is missing)")


def _stop_with(parent: int) -> Callable[[], None]:
    """In the child before exec: SIGTERM when the demo dies, however it dies (Linux), so a killed demo leaves no
    `realloc run` going on (the run stops its workers on SIGTERM)."""
    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the demo died before the signal was set
            os._exit(1)
    return arm


def _realloc(args: list[str], log: Path | None = None) -> None:
    """``realloc ARGS`` in a child process (its output to ``log`` when given); one error if it fails."""
    cmd = [sys.executable, "-m", "realloc.cli", *args]
    arm = _stop_with(os.getpid()) if sys.platform == "linux" else None
    if log is None:
        r = subprocess.run(cmd, preexec_fn=arm)
    else:
        with open(log, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=arm)
    if r.returncode:
        where = f"; its output is in {log}" if log else ""
        raise RuntimeError(f"`realloc {' '.join(args)}` failed with exit code {r.returncode}{where}")


def _search(search_time: float | None) -> list[str]:
    """``--search-time`` when one is given; else realloc searches until the plan stops improving (well under a
    second for the demo's 2 devices, where a fixed 5 s search made start-up 5 s longer)."""
    return [] if search_time is None else ["--search-time", str(search_time)]


def build_sft(root: Path = ROOT, run_dir: Path | None = None, search_time: float | None = None,
              out: Path | None = None) -> Path:
    """Run the SFT experiment through realloc (its own iterations) and export the actor into ``out``
    (default ``root/sft``)."""
    init_checkpoint(root)
    run_dir = run_dir or REPO / "runs" / "arith_sft"
    clear_run_dir(run_dir)  # refused while a peer's run uses it
    run_dir.mkdir(parents=True)
    t0 = time.time()
    # The initial model named explicitly: `root` need not be where the experiment file looks by default.
    _realloc(["run", str(SFT_EXPERIMENT), *_search(search_time), "--run-dir", str(run_dir),
              "--save-every", str(_default_iterations(SFT_EXPERIMENT)), "--quiet", "--set", f"init={root / 'init'}"],
             log=run_dir / "sft.log")
    target = (out or root / "sft").resolve()
    tmp = target.with_name(f".{target.name}.export")
    shutil.rmtree(tmp, ignore_errors=True)
    _realloc(["export", str(run_dir), "--model", "actor", "--out", str(tmp)], log=run_dir / "export.log")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print(f"SFT stage: {time.time() - t0:.0f} s through realloc ({run_dir}/sft.log); checkpoint {target}")
    return target


def _default_iterations(experiment: Path) -> int:
    from realloc.api import load_experiment

    return int(load_experiment(str(experiment)).config.iterations)


def accuracy(checkpoint: Path) -> Accuracy:
    """Exact match of ``checkpoint`` on the held-out prompts, greedy, with transformers."""
    from realloc.demo.accuracy import exact_match_accuracy

    return exact_match_accuracy(checkpoint, EVAL_PROMPTS, max_new_tokens=MAX_NEW_TOKENS)


def demo(root: Path = ROOT, run_dir: Path | None = None, rebuild_sft: bool = False, search_time: float | None = None,
         iterations: int | None = None) -> tuple[float, float]:
    """The whole demo; returns the held-out exact-match accuracy before and after GRPO."""
    t0 = time.time()
    run_dir = run_dir or REPO / "runs" / "arith_demo"
    clear_run_dir(run_dir)  # first: a peer's demo running there is one error at once, before any of the work
    sft, start = SHIPPED_SFT, []
    if rebuild_sft:
        print(f"training the SFT stage again (into {root / 'sft'}; the demo starts from it)", flush=True)
        sft = build_sft(root, search_time=search_time)
        start = ["--set", f"init={sft}"]
    before = accuracy(sft)
    print(f"before GRPO (the SFT model): {before.describe()} on held-out prompts, e.g. "
          + ", ".join(f"{p}{r}" for p, r, _ in before.examples[:3]), flush=True)
    n = iterations or _default_iterations(GRPO_EXPERIMENT)
    t1 = time.time()
    _realloc(["run", str(GRPO_EXPERIMENT), *_search(search_time), "--run-dir", str(run_dir),
              "--iterations", str(n), "--save-every", str(n), "--quiet", *start])
    grpo_seconds = time.time() - t1
    _realloc(["export", str(run_dir), "--model", "actor", "--out", str(run_dir / "actor-hf")], log=run_dir / "export.log")
    after = accuracy(run_dir / "actor-hf")
    print(f"after GRPO: {after.describe()}, e.g. " + ", ".join(f"{p}{r}" for p, r, _ in after.examples[:3]))
    print(f"held-out exact match {before.accuracy:.1%} -> {after.accuracy:.1%}, right value in any form "
          f"{before.value_accuracy:.1%} -> {after.value_accuracy:.1%} ({n} GRPO iterations in "
          f"{grpo_seconds:.0f} s; {time.time() - t0:.0f} s in all; run directory {run_dir})")
    return before.accuracy, after.accuracy


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m realloc.demo.arith_demo", description=__doc__.split("\n")[0])
    p.add_argument("stage", nargs="?", choices=["demo", "sft", "init"], default="demo")
    p.add_argument("--rebuild-sft", action="store_true",
                   help="train the SFT stage again (into experiments/data/arith/sft) and start GRPO from it")
    p.add_argument("--out", default=None, help="the sft stage's checkpoint directory (default "
                   "experiments/data/arith/sft); the init stage's (default experiments/data/arith_init, kept if it "
                   "exists)")
    p.add_argument("--search-time", type=float, default=None, help="seconds of plan search per run (default: "
                   "until the plan stops improving)")
    p.add_argument("--iterations", type=int, default=None, help="GRPO iterations (default: the experiment's)")
    p.add_argument("--run-dir", default=None, help="GRPO run directory (default runs/arith_demo)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_source_tree()
        if args.stage == "init":
            print(init_checkpoint(target=Path(args.out) if args.out else SHIPPED_INIT))
        elif args.stage == "sft":
            build_sft(search_time=args.search_time, out=Path(args.out) if args.out else None)
        else:
            demo(run_dir=Path(args.run_dir) if args.run_dir else None, rebuild_sft=args.rebuild_sft,
                 search_time=args.search_time, iterations=args.iterations)
    except (ValueError, RuntimeError) as e:
        print(f"arith_demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
