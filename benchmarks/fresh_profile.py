"""A profile of this machine taken now, so that a benchmark's estimates see the machine's current speed.

    .venv/bin/python benchmarks/fresh_profile.py --model small [--model ...] --out DIR [--rows 4 --seq 32]

The shipped ``profiles/cpu/*.json`` were measured on some other hour of this shared host; a VM's speed drifts
by 10-25% between hours (docs/fused-training.md measured the same serial step at 0.69 s and at 0.77 s), and
every estimate scales with it. This runs ``realloc profile`` itself (the same workers, ops and fits), for tp 1
on a small grid of batch sizes and sequence lengths around the shapes a benchmark runs (``grid_around``), and
writes what ``--profiles DIR`` / ``$REALLOC_PROFILES`` read: ``DIR/<kind>/<model>.json`` and a copy of the
shipped ``DIR/hardware/<kind>.json``. On the 2-core machine ``small`` takes about 15 s. Outside the grid, the
estimator extrapolates along the roofline as it does beyond any profile's grid, so the tables fit the
benchmark's calls, not a whole search.

Importable: ``profile_models(models, out, rows=..., seq=...)`` returns the folder, ``use(out)`` points this
process (and the ``realloc run`` processes it starts) at it, ``model_types(graph)`` names what an experiment
needs, ``profile_note(cost)`` says which tables a ``CostModel`` read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from realloc import cli  # noqa: E402
from realloc.estimator.hardware import PROFILES_ENV, shipped_profiles_dir  # noqa: E402

REPEATS = 5  # timed runs per point (the shipped tables: 9); the median is kept


def _bracket(x: int, lo: int) -> list[int]:
    """Powers of two around ``x``: the largest at or below it (at least ``lo``), its half and its double."""
    p = lo
    while p * 2 <= x:
        p *= 2
    return sorted({max(p // 2, lo), p, p * 2})


def grid_around(rows: int, seq: int) -> dict[str, str]:
    """``realloc profile``'s grid options for micro-batches of ``rows`` sequences of ``seq`` tokens: batch sizes
    and sequence lengths that bracket them (interpolation, never extrapolation, at the benchmark's shapes), and
    two cache lengths (decode is not what these benchmarks estimate)."""
    return {"batch-sizes": ",".join(map(str, _bracket(rows, 1))), "seq-lens": ",".join(map(str, _bracket(seq, 8))),
            "ctx-lens": "8,16"}


def model_types(graph: Any) -> list[str]:
    """The profiled model types of an experiment's graph (a critic shares its actor's table)."""
    from realloc.models.config import CRITIC_SUFFIX, RULE_MODEL_TYPE

    return sorted({t.removesuffix(CRITIC_SUFFIX) for t in graph.model_types.values()} - {RULE_MODEL_TYPE})


def profile_models(models: Iterable[str], out: Path, *, rows: int = 4, seq: int = 32, kind: str = "cpu",
                   tp: str = "1", repeats: int = REPEATS, quiet: bool = True) -> Path:
    """``realloc profile`` of every model into ``out/<kind>/<model>.json`` on ``grid_around(rows, seq)``, and the
    shipped hardware spec copied to ``out/hardware/<kind>.json``; returns ``out``."""
    out = Path(out)
    (out / "hardware").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shipped_profiles_dir() / "hardware" / f"{kind}.json", out / "hardware" / f"{kind}.json")
    grid = [x for k, v in grid_around(rows, seq).items() for x in (f"--{k}", v)]
    for model in models:
        argv = ["profile", "--model", model, "--device", "cpu" if kind.startswith("cpu") else "cuda", "--kind", kind,
                "--tp", tp, *grid, "--repeats", str(repeats), "--out", str(out / kind / f"{Path(model).name}.json")]
        if quiet:
            argv.append("--quiet")
        rc = cli.main(argv)
        if rc != 0:
            raise RuntimeError(f"realloc {' '.join(argv)} failed (exit code {rc})")
    return out


def use(out: Path) -> None:
    """Read ``out`` before the shipped profiles in this process and every process it starts (``--profiles``)."""
    os.environ[PROFILES_ENV] = str(Path(out).resolve())


def profile_note(cost: Any) -> str:
    """Which tables a ``CostModel`` priced with: model, where from, when taken and the load then."""
    notes = []
    for t in cost.profiles:
        meta = t.meta
        load = meta.get("load_average_before")
        notes.append(f"{t.model_type} taken {str(meta.get('created', '?'))[:16]} (load {load[0] if load else '?'}, "
                     f"{meta.get('seconds', '?')} s)")
    return "; ".join(notes) or "no profile (roofline)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="model type to profile (repeatable)")
    p.add_argument("--out", required=True, help="profiles folder to write (pass it as --profiles DIR)")
    p.add_argument("--rows", type=int, default=4, help="sequences per micro-batch the benchmark runs")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence the benchmark runs")
    p.add_argument("--tp", default="1", help="tensor-parallel degrees, as realloc profile --tp")
    p.add_argument("--repeats", type=int, default=REPEATS)
    args = p.parse_args()
    out = profile_models(args.model, Path(args.out), rows=args.rows, seq=args.seq, tp=args.tp, repeats=args.repeats,
                         quiet=False)
    print(f"profiles in {out}: pass --profiles {out} (or set {PROFILES_ENV}={out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
