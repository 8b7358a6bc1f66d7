"""What tails the runtime still refuses (docs/tail-semantics.md, "Limits"): a generation at pp > 1 with a migrating
tail entry is one line at ``realloc show --plan``, naming the call and the fix, before anything starts; streaming
(instances=0) runs at pp > 1 (tests/test_stream_pp.py)."""

from realloc.api import load_experiment
from realloc.cli import EXIT_USAGE, main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan

PPO = "experiments/ppo_7b_7b.py"


def test_show_refuses_a_tail_at_pp_2_in_one_line(tmp_path, capsys):
    graph = build_graph(load_experiment(PPO))
    places = {c: ("trainer[01-02]", 4, 2, 2, 4) for c in graph.spec.call_names}
    for tail, code in (({}, 0), ({"actor_gen": (100, 1)}, EXIT_USAGE), ({"actor_gen": (100, 0)}, 0)):
        plan = tmp_path / "plan.json"
        ExecutionPlan.by_hand(graph, places, tail=tail).save(plan)
        assert main(["show", PPO, "--plan", str(plan)]) == code
        err = capsys.readouterr().err
        if code:
            assert err.count("\n") == 1 and "Traceback" not in err
            assert err.startswith("realloc show: error: plan field 'tail' entry 'actor_gen': the runtime migrates "
                                  "the tail of a generation at pp 1 only (it streams at any pp: instances=0), and the "
                                  "call runs at pp 2; place it with pp=1, set instances=0 or drop the entry")
