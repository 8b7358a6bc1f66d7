"""`realloc search` end to end, in process."""

from __future__ import annotations

from realloc.api import load_experiment
from realloc.cli import main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan, validate_plan

TINY = "experiments/ppo_tiny.py"


def test_dry_run_prints_plan_comparison_and_stats_and_writes_files(tmp_path, capsys):
    out, svg = tmp_path / "plan.json", tmp_path / "timeline.svg"
    rc = main(["search", TINY, "--dry-run", "--evals", "20000", "--threads", "1", "--out", str(out),
               "--timeline", str(svg)])
    text = capsys.readouterr().out
    assert rc == 0
    for needle in ("cluster    localhost: 1 node(s) x 2 cpu", "searched plan", "actor_gen", "rew_inf",
                   "estimated time per iteration", "vs heuristic", "heuristic", "colocate-dp", "split",
                   "peak memory", "plans evaluated", "best found after"):
        assert needle in text, needle
    plan = ExecutionPlan.load(out)
    validate_plan(plan, build_graph(load_experiment(TINY)))
    assert plan.source == "search" and plan.estimated_time > 0 and set(plan.call_times) == set(plan.placements)
    assert svg.read_text().lstrip().startswith("<?xml") and "actor_train" in svg.read_text()


def test_timeline_html_and_baseline_option(tmp_path, capsys):
    page = tmp_path / "t.html"
    assert main(["search", TINY, "--evals", "4000", "--threads", "1", "--timeline", str(page)]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>") and "<svg" in page.read_text()
    capsys.readouterr()
    out = tmp_path / "heuristic.json"
    assert main(["search", TINY, "--baseline", "heuristic", "--out", str(out)]) == 0
    assert "baseline   heuristic" in capsys.readouterr().out
    assert ExecutionPlan.load(out).source == "baseline:heuristic"


def test_nothing_fits_exits_nonzero_with_the_shortfall(tmp_path, capsys):
    exp = tmp_path / "too_big.py"
    exp.write_text(
        "import dataclasses\n"
        "from realloc.algorithms.ppo.ppo_config import ppo_rpcs\n"
        "from realloc.api import auto\n\n"
        "@auto(nodelist='localhost', n_devices_per_node=2, device='cpu', batch_size=32, prompt_len=8, gen_len=8)\n"
        "@dataclasses.dataclass\n"
        "class TooBig:\n"
        "    @property\n"
        "    def rpcs(self):\n"
        "        return ppo_rpcs(actor='llama3-70b', critic='llama3-8b-critic', n_minibatches=2)\n")
    rc = main(["search", str(exp), "--dry-run", "--evals", "1000"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "nothing fits in memory" in err and "GiB" in err and "call '" in err


def test_bad_timeline_suffix_is_one_clear_error(capsys):
    assert main(["search", TINY, "--evals", "100", "--timeline", "plan.pdf"]) == 2
    assert "use a .svg, .png or .html file" in capsys.readouterr().err


def test_long_call_and_mesh_names_keep_their_columns(tmp_path, capsys):
    """A 16+ character call name used to run into the mesh column (issue 14, item 9)."""
    exp = tmp_path / "long_names.py"
    exp.write_text(
        "import dataclasses\n"
        "from realloc.algorithms.ppo.ppo_config import ppo_rpcs\n"
        "from realloc.api import auto\n\n"
        "LONG = {'actor_gen': 'actor_generation_step', 'actor_train': 'actor_training_step_xx'}\n\n"
        "@auto(nodelist='very-long-hostname-01', n_devices_per_node=2, device='cpu', batch_size=32, prompt_len=8,"
        " gen_len=8)\n"
        "@dataclasses.dataclass\n"
        "class LongNames:\n"
        "    @property\n"
        "    def rpcs(self):\n"
        "        return [dataclasses.replace(r, name=LONG.get(r.name, r.name))\n"
        "                for r in ppo_rpcs(actor='tiny', critic='tiny-critic', n_minibatches=2)]\n")
    assert main(["search", str(exp), "--evals", "2000", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    table = text.split("searched plan\n")[1].split("\n\n")[0].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:] if not line.startswith(("offloaded", " "))}
    assert {"actor_generation_step", "actor_training_step_xx"} <= set(rows)
    for name, cols in rows.items():
        assert cols[1].startswith("very-long-hostname-01"), (name, cols)  # the mesh is its own column
        assert len(cols) == 10, cols  # call, mesh, devices, dp, tp, pp, mbs, recomp, est. s, peak


def test_weak_scaling_dry_run_reports_the_searched_plan_against_a_heuristic_that_fits(capsys):
    """issue 13 item 3: the paper's 128-GPU weak-scaling point plans end to end, the heuristic fits (with
    recomputation) and the searched plan is reported against it; a short search already beats it."""
    assert main(["search", "experiments/ppo_70b_7b_weak_scaling.py", "--dry-run", "--evals", "20000",
                 "--threads", "1"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in ("searched", "heuristic")}
    searched, heuristic = float(rows["searched"][1]), float(rows["heuristic"][1])
    assert rows["heuristic"][-1] == "yes" and rows["searched"][-1] == "yes"
    assert rows["heuristic"][2] == "1.00x" and searched < heuristic
    assert rows["searched"][2] == f"{heuristic / searched:.2f}x"


def test_search_and_show_print_the_same_group_sampling_batch(capsys):
    """A GRPO graph's batch is 8 prompts of 4 responses each: search used to print "batch 8" where show printed it
    whole."""
    want = "workload   batch 8 prompts x 4 responses = 32 sequences, prompt 8 + generation 8 tokens"
    assert main(["show", "experiments/grpo_tiny.py"]) == 0
    assert want in capsys.readouterr().out
    assert main(["search", "experiments/grpo_tiny.py", "--dry-run", "--evals", "500", "--threads", "1"]) == 0
    assert want + ", 4 calls;" in capsys.readouterr().out
    assert main(["search", "experiments/grpo_tiny.py", "--baseline", "heuristic"]) == 0
    assert want in capsys.readouterr().out
    assert main(["show", TINY]) == 0  # one response per prompt: the batch is its size
    assert "workload   batch 32, prompt 8" in capsys.readouterr().out
