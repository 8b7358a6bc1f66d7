"""The ``realloc`` command. User errors end in one readable line and a non-zero exit.

This file builds the parser; each subcommand is ``main(args) -> int`` in ``<command>_cli.py`` at the top of
the package whose code it drives: ``estimator/profile_cli.py``, ``search/search_cli.py``, and
``runtime/{show,run,trace,export}_cli.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import importlib
import os
import sys
from typing import Any, Sequence

from realloc import user_code

# `realloc run` without --search-time searches until the plan stops improving, for at most this long
# (search/planner.py); kept here so that the parser needs no subcommand's imports.
DEFAULT_SEARCH_TIME = 10.0

EXIT_USAGE = 2
# OSErrors of the machine's storage and of paths the user gave, reported as one line naming the path and the cause
_STORAGE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                             errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def _set_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an experiment field, e.g. --set ppo.lr=1e-6 --set batch_size=64 (repeatable)")


def _profiles_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--profiles", default=None, metavar="DIR",
                   help="your own profiles folder (DIR/<device kind>/<model>.json, DIR/hardware/<kind>.json), read "
                        "before the shipped ones; same as $REALLOC_PROFILES")


def _use_profiles(args: argparse.Namespace) -> None:
    """``--profiles DIR`` is ``$REALLOC_PROFILES=DIR`` for this process and the workers it starts."""
    folder = getattr(args, "profiles", None)
    if folder is None:
        return
    from realloc.estimator.hardware import PROFILES_ENV

    if args.command != "profile" and not os.path.isdir(folder):
        raise ValueError(f"--profiles {folder!r}: no such folder")
    os.environ[PROFILES_ENV] = os.path.abspath(folder)


def version() -> str:
    """``realloc --version``: the installed distribution's version, else the source tree's pyproject.toml."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("realloc")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source tree, not installed)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown (not installed)"


@dataclasses.dataclass(frozen=True)
class _Command:
    """A subcommand's ``main`` in ``module``, imported when it runs: each command imports only what it uses
    (``realloc run`` never loads the profiler's torch code)."""

    module: str

    def __call__(self, args: argparse.Namespace) -> Any:
        return importlib.import_module(self.module).main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="realloc", description="Plan and run RLHF dataflow graphs with parameter "
                                "reallocation.")
    p.add_argument("--version", action="version", version=f"realloc {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("show", help="validate an experiment and print its graph and candidate counts")
    s.add_argument("experiment", help="experiment file (path/exp.py[:Class]) or module")
    s.add_argument("--plan", default=None, help="also check this execution plan JSON against the experiment and "
                   "its cluster (a hand-written plan: meshes, pools, strategies)")
    _set_option(s)
    s.set_defaults(func=_Command("realloc.runtime.show_cli"))

    s = sub.add_parser("profile", help="measure per-layer and collective costs on this machine")
    s.add_argument("--model", required=True, help="model type, e.g. tiny or llama3-8b, or an HF checkpoint directory")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to measure (default cpu)")
    s.add_argument("--tp", default="1", help="comma-separated tensor-parallel degrees to profile")
    s.add_argument("--out", default=None, help="output JSON path (default: <--profiles DIR>/<device>/<model>.json)")
    s.add_argument("--kind", default=None, help="device kind of profiles/hardware/<kind>.json (cpu by default; "
                   "required with --device cuda, e.g. a100-80g)")
    s.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="measure in another of the "
                   "kind's dtypes (a pool's dtype; default the kind's own); writes <model>-<dtype>.json")
    s.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default 1,2,4,...,64)")
    s.add_argument("--seq-lens", default=None, help="comma-separated sequence lengths (default 8,16,...,256)")
    s.add_argument("--ctx-lens", default=None, help="comma-separated KV-cache lengths for decode (default 8,...,512)")
    s.add_argument("--collectives", default=None, help="comma-separated process counts for collectives "
                   "(default 2,4,... up to max(tp, 2))")
    s.add_argument("--max-bytes", type=int, default=None, help="largest collective message in bytes (default 64 MiB)")
    s.add_argument("--warmup", type=int, default=None, help="untimed runs per point (default 2)")
    s.add_argument("--repeats", type=int, default=None, help="timed runs per point; the median is kept (default 7)")
    s.add_argument("--clock", default=None, choices=["wall", "wall-min", "cpu"], help="time layer ops in wall time "
                   "(default, the median repeat), in wall time's fastest repeat (wall-min: others' load only adds "
                   "time), or in the process's CPU time, which a shared machine's other processes do not inflate "
                   "(tp 1, cpu)")
    s.add_argument("--co-run", action="store_true", help="every device times the layer ops at once, as a run keeps "
                   "them all busy (on CPUs their cores share caches and memory); rank 0's times are kept")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    _profiles_option(s)
    s.set_defaults(func=_Command("realloc.estimator.profile_cli"))

    s = sub.add_parser("search", help="search an execution plan and report it (plans only; `realloc run` trains)")
    s.add_argument("experiment", help="experiment file (path/exp.py[:Class]) or module")
    # search never launches workers: --dry-run changes nothing (kept so old command lines work; it says so)
    s.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    s.add_argument("--search-time", dest="time", type=float, default=None, metavar="SECONDS",
                   help="search time limit in seconds (default: until the best plan stops improving, at "
                   "most 10 s; none with --evals); `run --search-time` alike")
    s.add_argument("--time", dest="time", type=float, help=argparse.SUPPRESS)  # the old name of --search-time
    s.add_argument("--evals", type=int, default=None, help="evaluation budget; with no --search-time the result depends "
                   "only on --seed and --threads")
    s.add_argument("--threads", type=int, default=2, help="search threads (one MCMC chain each)")
    s.add_argument("--seed", type=int, default=0, help="random seed of the search's chains (default 0)")
    s.add_argument("--baseline", default=None, choices=["heuristic", "colocate-dp", "split"],
                   help="print (and --out) this baseline plan instead of searching")
    s.add_argument("--out", default=None, help="write the plan JSON here")
    s.add_argument("--timeline", default=None, help="write a timeline picture (.svg/.png/.html)")
    s.add_argument("--lengths-from", default=None, metavar="RUN_DIR",
                   help="price the response lengths an earlier run logged (its samples.jsonl) instead of the "
                        "experiment's response_lengths (docs/long-tail.md), and a multi-turn rollout's turns and "
                        "tool time (docs/multi-turn.md)")
    _set_option(s)
    _profiles_option(s)
    s.set_defaults(func=_Command("realloc.search.search_cli"))

    s = sub.add_parser("run", help="run the experiment on its cluster")
    s.add_argument("experiment", help="experiment file (path/exp.py[:Class]) or module")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--plan", default=None, help="execution plan JSON to run (from `realloc search --out`, or "
                   "written by hand: docs/search.md)")
    g.add_argument("--search-time", type=float, default=None, metavar="SECONDS",
                   help=f"search a plan for this many seconds before training (default: until the plan stops "
                        f"improving, at most {DEFAULT_SEARCH_TIME:g} s, when neither --plan nor --baseline is given)")
    g.add_argument("--baseline", default=None, choices=["heuristic", "colocate-dp", "split"],
                   help="run this baseline plan instead of searching (`realloc search EXP --baseline NAME` "
                        "prints it)")
    s.add_argument("--no-fused-pairs", action="store_true", help="search without fused train pairs (RLHFuse "
                   "fusion, docs/fused-training.md): an opt-out while NCCL's fused pairs are unproven on GPUs")
    s.add_argument("--iterations", type=int, default=None, help="iterations to run up to, counted from 1 "
                   "(default: the experiment's `iterations`)")
    s.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint: a run directory (its newest checkpoint), its checkpoints/ "
                        "folder, or one checkpoints/iter_<N> directory")
    s.add_argument("--schedule-iterations", type=int, default=None, metavar="N",
                   help="iterations the learning-rate schedule spans (default: this run's --iterations; a resumed "
                        "run keeps its checkpoint's)")
    s.add_argument("--skip-checkpoint-checks", action="store_true",
                   help="with --resume: load the checkpoint without checking its files' SHA-256 and presence")
    s.add_argument("--run-dir", default=None, help="output directory (default runs/<experiment>-<time>)")
    s.add_argument("--save-every", type=int, default=0, help="also checkpoint every N iterations (0: only the "
                   "final state)")
    s.add_argument("--final-checkpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="checkpoint the state after the last iteration, for `realloc export` and --resume (default on)")
    s.add_argument("--keep-checkpoints", type=int, default=3, metavar="N",
                   help="after each checkpoint, delete all but the newest N (default 3; 0 keeps all)")
    s.add_argument("--allow-changed-settings", action="store_true",
                   help="with --resume: train on although a setting differs from the checkpoint's run (a new --set "
                        "or an edited experiment file); without it such a resume is refused, naming the difference")
    s.add_argument("--export-every", type=int, default=0, help="every N iterations (and after the last), also "
                   "write each trained model as a HuggingFace directory under RUN_DIR/exports/ (0: never)")
    s.add_argument("--launcher", default="local", choices=["local", "slurm", "ray", "external"],
                   help="local subprocesses, a SLURM job, Ray actors, or workers started elsewhere (used inside "
                        "the SLURM job)")
    s.add_argument("--ray-address", default=None, help="with --launcher ray: the cluster (default $RAY_ADDRESS, or "
                   "a private local instance on 127.0.0.1)")
    s.add_argument("--dry-run", action="store_true", help="with --launcher slurm: print the script; write and "
                   "submit nothing")
    s.add_argument("--prepare", action="store_true", help="with --launcher slurm: write the run directory (plan, "
                   "secret, job.sbatch) but do not submit")
    _set_option(s)
    g = s.add_argument_group("SLURM (--launcher slurm)")
    g.add_argument("--partition", action="append", default=None, help="SLURM partition (default: the cluster's); "
                   "on a cluster of pools once for all or once per pool, in pool order")
    g.add_argument("--account", default=None, help="SLURM account to charge")
    g.add_argument("--time", default="24:00:00", metavar="D-HH:MM:SS",
                   help="the job's wall-clock limit, SLURM's --time (default 24:00:00); not the plan search's "
                        "time, which is --search-time")
    g.add_argument("--job-name", default="realloc", help="SLURM job name (default realloc)")
    g.add_argument("--nodelist", action="append", default=None, help="pin the job to these hosts (by default SLURM "
                   "picks; node i of the plan runs on the i-th allocated node); with pools, once per pool")
    g.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per device (default: the whole node, "
                   "--exclusive, split evenly among its devices)")
    g.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="another #SBATCH option, e.g. --sbatch qos=high (repeatable)")
    g.add_argument("--setup", action="append", default=[], metavar="SHELL",
                   help="a shell line run first in the job, e.g. --setup 'module load cuda' (repeatable)")
    g.add_argument("--srun-arg", action="append", default=[], metavar="OPTION",
                   help="an srun option for the workers, e.g. --srun-arg container-image=IMAGE (repeatable)")
    g.add_argument("--python", default=None, metavar="PATH",
                   help="the interpreter of the master and workers in the job (default: this one, by its absolute "
                        "path; python3 from the job's PATH when --setup lines or a container image are given)")
    g.add_argument("--mem", default=None, metavar="SIZE", help="memory per node, SLURM's --mem (e.g. 200G; 0: all)")
    g.add_argument("--gres", action="append", default=None, metavar="SPEC",
                   help="request the GPUs as --gres gpu[:TYPE][:COUNT] (e.g. gpu:a100; the count is the devices per "
                        "node) instead of --gpus-per-node; with pools, once for all or once per pool")
    s.add_argument("--quiet", action="store_true", help="no progress bar: plain lines (one per iteration, with the "
                   "ETA, and one per call running over a minute), as without a terminal")
    s.add_argument("--heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                   help="a worker silent this long counts as hung and the run stops about 1 s later (default 6; "
                   "raise it if workers hold the GIL for long, e.g. while writing huge checkpoints)")
    s.add_argument("--call-timeout", type=float, default=None, metavar="SECONDS",
                   help="a worker busy with one request this long counts as stuck (e.g. in a collective another "
                   "rank never entered; its heartbeats go on) and the run stops (default 1800, torch's own "
                   "collective timeout)")
    s.add_argument("--warning-signal", default="USR1@120", metavar="SIGNAL@SECONDS",
                   help="this signal means the run is killed SECONDS later: like SIGTERM (30 s), finish the "
                   "iterations in flight, save a checkpoint if it fits, exit; SLURM jobs request it with "
                   "--signal=B:SIGNAL@SECONDS (default USR1@120)")
    s.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="write TensorBoard event files to RUN/tensorboard (default on)")
    s.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to Weights & Biases (offline "
                   "unless WANDB_MODE/WANDB_API_KEY say otherwise; needs the wandb package)")
    for hidden, kind, default in (("--run-id", str, None), ("--bind", str, "127.0.0.1"), ("--store-port", int, 0),
                                  ("--master-port", int, 0)):
        s.add_argument(hidden, type=kind, default=default, help=argparse.SUPPRESS)  # set by the SLURM script
    _profiles_option(s)
    s.set_defaults(func=_Command("realloc.runtime.run_cli"))
    _add_trace(sub)

    s = sub.add_parser("export", help="write a trained model of a run's checkpoint as a HuggingFace directory")
    s.add_argument("run_dir", help="run directory (or its checkpoints/ or one checkpoint directory)")
    s.add_argument("--model", required=True, help="the trained model to export, e.g. actor or critic")
    s.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    s.add_argument("--iteration", type=int, default=None,
                   help="the checkpoint after this many iterations (default: the newest)")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight dtype of the files (default: the checkpoint's)")
    s.add_argument("--skip-checkpoint-checks", action="store_true",
                   help="do not check the shards against the SHA-256 recorded when they were saved")
    s.add_argument("--format", default="hf", choices=["hf", "peft"],
                   help="hf: a full checkpoint (LoRA adapters merged into the base); peft: a LoRA model's adapters "
                        "as PEFT writes them (adapter_config.json + adapter_model.safetensors)")
    s.set_defaults(func=_Command("realloc.runtime.export_cli"))
    return p


def _add_trace(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("trace", help="draw a run's measured timeline next to its plan's estimate")
    s.add_argument("run_dir", help="the run directory of a `realloc run`")
    s.add_argument("--timeline", required=True, help="picture to write (.svg/.png, or .html with details on hover)")
    s.add_argument("--iterations", default="1..3", help="which iterations, A..B counted from 1 (default 1..3)")
    s.add_argument("--experiment", default=None, help="the experiment, if the run has no run.json")
    s.add_argument("--no-estimate", action="store_true", help="only the measured timeline")
    s.add_argument("--common-scale", action="store_true", help="draw the measured and estimated panels on one time "
                   "axis (default: each on its own, which the titles say)")
    _profiles_option(s)
    s.set_defaults(func=_Command("realloc.runtime.trace_cli"))


def _unknown_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """One line for a first word that is no command, with the nearest one (``realloc serach``); None otherwise."""
    import difflib

    first = next((a for a in argv if not a.startswith("-")), None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if first is None or first in sub.choices or argv[0] != first:
        return None
    near = difflib.get_close_matches(first, list(sub.choices), n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"realloc: error: unknown command {first!r}{hint} (commands: {', '.join(sub.choices)})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = _unknown_command(parser, argv)
    if unknown:
        print(unknown, file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    try:
        _use_profiles(args)
        return int(args.func(args) or 0)
    except ValueError as e:
        # Raised in (or through) the user's own code, e.g. a module the experiment imports: name their line.
        print(f"realloc {args.command}: error: {e}{user_code.where(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"realloc {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in _STORAGE_ERRORS or os.environ.get("REALLOC_DEBUG"):
            return _internal_error(args.command, e)
        # A full disk, a quota, a read-only or forbidden folder: the user's machine, not realloc, named as such.
        from realloc.runtime.records.run_paths import os_error_line

        print(f"realloc {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the CLI promises no tracebacks
        return _internal_error(args.command, e)


def _internal_error(command: str, e: Exception) -> int:
    if os.environ.get("REALLOC_DEBUG"):
        raise e
    if user_code.user_frame(e.__traceback__) is not None:  # the user's code failed, not realloc
        print(f"realloc {command}: error: {type(e).__name__}: {e}{user_code.where(e)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"realloc {command}: internal error: {type(e).__name__}: {e} (set REALLOC_DEBUG=1 for a traceback)",
          file=sys.stderr)
    return 1


def entry() -> None:
    """The ``realloc`` program: ``main``, then exit without collecting every object of torch and megatron
    one by one (seconds on a busy machine, which a stopped run would otherwise spend before it is gone).

    ``realloc run`` starts without the cyclic collector, which would scan every object of its imports again and
    again while they arrive; the run turns it on before training (``records/startup.py``, ``settle_heap``)."""
    if sys.argv[1:2] == ["run"]:
        gc.disable()
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
