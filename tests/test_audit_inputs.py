"""Audit of the newest inputs (issues 31-35): hand-written plans at `realloc show`, malformed turn profiles and
run records, a tool's forged result line. Each bad input is one clear error naming what to fix, no traceback."""

import json

import pytest

from realloc.api import load_experiment
from realloc.cli import EXIT_USAGE, main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan


def plan_file(tmp_path, experiment, place, *, gen=None, **fields):
    graph = build_graph(load_experiment(f"experiments/{experiment}.py"))
    places = {n: gen if n == "actor_gen" and gen else place for n in graph.spec.call_names}
    plan = json.loads(ExecutionPlan.by_hand(graph, places).to_json())
    plan.update(fields)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


@pytest.mark.parametrize("experiment, place, fields, extra, message", [
    ("calc_grpo_tool", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 1}}}, [],
     "generates turn by turn"),
    ("calc_grpo_tool", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 0}}}, [],
     "generates turn by turn"),
    ("ppo_tiny", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 0}},
                                             "gen": ("localhost", 1, 1, 2, 1)}, [],
     "pp 1 only"),
    ("ppo_tiny", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 1}}, "staleness": 1},
     ["--set", "max_staleness=1"], "staleness 1"),
])
def test_show_refuses_a_tail_entry_that_run_refuses(tmp_path, capsys, experiment, place, fields, extra, message):
    """`realloc show --plan` said "valid" for tail entries that `realloc run` then refused (RuntimeProgram)."""
    path = plan_file(tmp_path, experiment, place, **fields)
    assert main(["show", f"experiments/{experiment}.py", "--plan", path, *extra]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan field 'tail' entry 'actor_gen'" in err[0] and message in err[0], err
