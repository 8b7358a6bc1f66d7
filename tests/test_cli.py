"""The realloc command: readable output, one-line errors, no tracebacks."""

import subprocess
import sys

from realloc.cli import EXIT_USAGE, build_parser, main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "realloc.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_subcommands():
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("profile", "search", "run", "show"):
        assert cmd in out.stdout


def test_show_prints_graph_and_candidate_counts(capsys):
    assert main(["show", "experiments/ppo_7b_7b.py"]) == 0
    out = capsys.readouterr().out
    assert "trainer[01-02]: 2 node(s) x 8 a100-80g" in out
    assert "actor_train      TRAIN_STEP ppo_actor on actor(llama3-8b)" in out
    counts = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  ")}
    # a train step's 622 (mesh, strategy, micro-batches) come with and without recomputation
    assert counts["actor_gen"] == "685" and counts["actor_train"] == str(2 * 622)


def test_bad_experiment_is_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import dataclasses\nfrom realloc.api import *\n"
                   "@auto(nodelist='localhost', batch_size=4)\n@dataclasses.dataclass\nclass E:\n"
                   "    @property\n    def rpcs(self):\n"
                   "        return [ModelFunctionCallDef(name='g', model_name='a', model_type='tiny',\n"
                   "                interface_type=GENERATE, input_data=['missing'])]\n")
    out = run_cli("show", str(bad))
    assert out.returncode == EXIT_USAGE
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0
    assert "call 'g' reads key 'missing'" in out.stderr


def test_every_subcommand_runs_its_modules_main():
    from realloc.estimator import profile_cli
    from realloc.runtime import export_cli, run_cli, show_cli, trace_cli
    from realloc.search import search_cli

    parser = build_parser()
    for argv, module in ((["show", "e.py"], show_cli), (["profile", "--model", "tiny"], profile_cli),
                         (["search", "e.py"], search_cli), (["run", "e.py"], run_cli),
                         (["trace", "runs/a", "--timeline", "t.svg"], trace_cli),
                         (["export", "runs/a", "--model", "actor", "--out", "hf"], export_cli)):
        func = parser.parse_args(argv).func  # imported when the command runs: the module named, and its main
        assert func.module == module.__name__ and callable(module.main), argv[0]


def test_run_rejects_zero_iterations_before_launching_anything():
    out = run_cli("run", "experiments/ppo_tiny.py", "--iterations", "0", "--run-dir", "/nonexistent/never-created")
    assert out.returncode == EXIT_USAGE
    assert "--iterations must be a positive integer, got 0" in out.stderr and "Traceback" not in out.stderr


def test_user_mistakes_are_not_internal_errors(tmp_path, capsys):
    bad = tmp_path / "exp.py"
    bad.write_text("import dataclasses\n\nVALUE = 1 / 0\n")
    assert main(["show", str(bad)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"realloc show: error: experiment file {bad}, line 3: importing it raised ZeroDivisionError")
    assert "internal error" not in err and len(err.strip().splitlines()) == 1
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    assert main(["run", "experiments/ppo_tiny.py", "--iterations", "1", "--run-dir", str(a_file)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--run-dir {a_file} is a file" in err and "internal error" not in err
    # A run directory under a file cannot be created: named, not an internal NotADirectoryError.
    under = a_file / "run"
    assert main(["run", "experiments/ppo_tiny.py", "--iterations", "1", "--run-dir", str(under)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"realloc run: error: run directory {under}: cannot create it"), err


def test_python_dash_m_realloc_runs_the_realloc_program():
    ok = subprocess.run([sys.executable, "-m", "realloc", "show", "experiments/grpo_tiny.py", "--set", "batch_size=2"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "workload   batch 2 prompts x 4 responses = 8 sequences" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "realloc", "show", "experiments/grpo_tiny.py", "--set", "grpo.lrr=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == EXIT_USAGE and bad.stderr.strip().count("\n") == 0 and "no field 'lrr'" in bad.stderr


def test_version_and_the_help_of_every_run_and_search_option():
    """Issue 22 item 19: --version; every option of run and search has help, and --time says which time it is."""
    import tomllib
    from pathlib import Path

    out = run_cli("--version")
    want = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert out.returncode == 0 and out.stdout.startswith(f"realloc {want}"), out.stdout
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for cmd in ("run", "search"):
        for action in subs[cmd]._actions:
            if action.help == "==SUPPRESS==" or action.dest in ("help", "experiment"):
                continue
            assert action.help, f"realloc {cmd} {action.option_strings}: no help"
    run_help = {o: a.help for a in subs["run"]._actions for o in a.option_strings}
    assert "wall-clock" in run_help["--time"] and "--search-time" in run_help["--time"]
    assert "run directory" in run_help["--resume"] and "checkpoints/iter_<N>" in run_help["--resume"]
    search_help = {o: a.help for a in subs["search"]._actions for o in a.option_strings}
    assert "search time" in search_help["--search-time"]
    # --time and --dry-run of `search` still parse (old command lines) but are not advertised
    args = parser.parse_args(["search", "e.py", "--time", "3", "--dry-run"])
    assert args.time == 3.0 and search_help["--time"] == search_help["--dry-run"] == "==SUPPRESS=="
    assert parser.parse_args(["search", "e.py", "--search-time", "4"]).time == 4.0


def test_search_dry_run_says_it_changes_nothing(capsys):
    assert main(["search", "experiments/ppo_tiny.py", "--dry-run", "--evals", "50", "--threads", "1"]) == 0
    assert "--dry-run changes nothing" in capsys.readouterr().err


def test_a_run_that_fails_before_launching_leaves_no_directory(tmp_path):
    """Issue 22 item 19: `--run-dir X` with a plan the experiment cannot run (or a bad --baseline) fails in one
    line and leaves neither X nor X/prompt_cache; an existing run directory is kept."""
    wrong = tmp_path / "wrong_plan.json"
    out = run_cli("search", "experiments/grpo_tiny.py", "--baseline", "heuristic", "--out", str(wrong))
    assert out.returncode == 0, out.stderr
    target = tmp_path / "a" / "b"
    for extra in (["--plan", str(wrong)], ["--baseline", "nope"]):
        out = run_cli("run", "experiments/ppo_tiny.py", "--iterations", "1", "--run-dir", str(target), *extra)
        assert out.returncode == EXIT_USAGE and "Traceback" not in out.stderr
        last = out.stderr.strip().splitlines()[-1]  # argparse prints its usage first
        assert last.startswith("realloc run: error:") and ("no placement" in last or "choose from" in last), out.stderr
        assert not (tmp_path / "a").exists()
    target.mkdir(parents=True)
    out = run_cli("run", "experiments/ppo_tiny.py", "--iterations", "1", "--run-dir", str(target), "--plan", str(wrong))
    assert out.returncode == EXIT_USAGE and target.is_dir()


def test_storage_errors_are_one_line_naming_the_path(monkeypatch, capsys):
    """A full disk or a forbidden folder is the machine's state, not a realloc bug: one line with the path and
    the cause, exit 1; any other OSError stays an internal error."""
    import errno
    import os

    from realloc.runtime import show_cli

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/a/metrics.jsonl")

    monkeypatch.setattr(show_cli, "main", full)
    assert main(["show", "e.py"]) == 1
    assert capsys.readouterr().err == "realloc show: error: /runs/a/metrics.jsonl: No space left on device\n"

    # raised by realloc's own code (an error in the user's code is reported as theirs, with its line): a function
    # compiled under show_cli's file name stands for it
    ns: dict = {}
    exec(compile("def odd(args):\n    raise OSError(9, 'Bad file descriptor')\n", show_cli.__file__, "exec"), ns)
    monkeypatch.setattr(show_cli, "main", ns["odd"])
    assert main(["show", "e.py"]) == 1
    assert "internal error: OSError" in capsys.readouterr().err


def test_search_refuses_an_output_in_a_missing_folder_before_searching(tmp_path, capsys):
    for option in ("--out", "--timeline"):
        target = tmp_path / "missing" / ("p.json" if option == "--out" else "t.svg")
        assert main(["search", "experiments/ppo_tiny.py", "--evals", "10", option, str(target)]) == EXIT_USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"realloc search: error: {option} {target}: folder {target.parent} does not exist; create "
                       f"it first"]
