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
        assert parser.parse_args(argv).func is module.main, argv[0]


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
