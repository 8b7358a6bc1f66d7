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
        "from realloc.algorithms.ppo_config import ppo_rpcs\n"
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
