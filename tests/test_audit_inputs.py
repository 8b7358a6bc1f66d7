"""Audit of the newest inputs (issues 31-35): hand-written plans at `realloc show`, malformed turn profiles and
run records, a tool's forged result line. Each bad input is one clear error naming what to fix, no traceback."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.parametrize("experiment, place, fields, extra", [
    ("calc_grpo_tool", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 1}}}, []),
    ("calc_grpo_tool", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 0}}}, []),
    ("ppo_tiny", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 0}},
                                             "gen": ("localhost", 1, 1, 2, 1)}, []),
    ("ppo_tiny", ("localhost", 2, 1, 1, 1), {"tail": {"actor_gen": {"rows": 4, "instances": 1}}, "staleness": 1},
     ["--set", "max_staleness=1"]),
])
def test_show_refuses_a_tail_entry_that_run_refuses(tmp_path, capsys, experiment, place, fields, extra):
    """`realloc show --plan` said "valid" for tail entries that `realloc run` then refused (RuntimeProgram's
    check_runtime_tail): a multi-turn generation, and (as long as the runtime refuses them) pp > 1 and staleness."""
    from realloc.graph.streaming import check_runtime_tail
    from realloc.overrides import load_with_overrides

    path = plan_file(tmp_path, experiment, place, **fields)
    graph = build_graph(load_with_overrides(f"experiments/{experiment}.py", extra[1::2]))
    try:
        check_runtime_tail(ExecutionPlan.load(path), graph)
        refused = None
    except ValueError as e:
        refused = str(e)
    if experiment == "calc_grpo_tool" and fields["tail"]["actor_gen"]["instances"]:
        assert refused and "generates turn by turn" in refused  # migrating an unfinished multi-turn rollout
    elif experiment == "calc_grpo_tool":
        assert refused is None  # streaming finished multi-turn rollouts runs (tests/test_multiturn_stream.py)
    code = main(["show", f"experiments/{experiment}.py", "--plan", path, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    if refused is None:
        assert code == 0 and not err, err
    else:
        assert code == EXIT_USAGE and err == [f"realloc show: error: {refused}"], err


@pytest.mark.parametrize("profile, message", [
    ({"policy_tokens": [4, 4], "reach": [1.0, 0.5, 0.2]}, "['reach'] has 3 entries but 'policy_tokens' has 2"),
    ({"policy_tokens": [4], "observation_tokens": [3, 3]}, "['observation_tokens'] has 2 entries but"),
    ({"policy_tokens": [4, 4], "reach": [0.5, 0.5]}, "['reach'][0] must be 1"),
    ({"policy_tokens": [4], "observation_tokens": 3}, "['observation_tokens'] must be a list of numbers"),
])
def test_a_declared_turn_profile_with_more_entries_than_turns_is_one_error(profile, message):
    """Lists longer than the turns were cut silently, and a first turn that not every rollout takes was priced."""
    from realloc.envs.turn_profile import declared_profile

    with pytest.raises(ValueError, match=r"call 'gen': interface_args\['turn_profile'\]") as e:
        declared_profile("gen", profile, 4)
    assert message in str(e.value)


@pytest.mark.parametrize("segments, metrics, message", [
    (["a", "b"], None, "has a turn_segments entry ['a', 'b']"),
    ([0, None], None, "has a turn_segments entry [0, None]"),
    ([0, [1]], None, "has a turn_segments entry"),
    ([0, 3.5], None, "has a turn_segments entry [0, 3.5]"),
    ([0, 3], {"calls": {"gen": {"env_obs_s": None, "env_obs_steps": 1}}}, "has env_obs_s=None for call 'gen'"),
    ([0, 3], {"calls": {"gen": {"env_obs_s": "x", "env_obs_steps": 1}}}, "has env_obs_s=x for call 'gen'"),
])
def test_lengths_from_a_malformed_multiturn_run_is_one_error_naming_the_file(tmp_path, segments, metrics, message):
    """A hand-edited samples.jsonl or metrics.jsonl gave a TypeError/AttributeError from deep in the sums."""
    from realloc.envs.turn_profile import turns_from_run

    (tmp_path / "samples.jsonl").write_text(json.dumps({"iteration": 1, "seq": 0, "turn_segments": segments}) + "\n")
    if metrics is not None:
        (tmp_path / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    with pytest.raises(ValueError, match=f"--lengths-from {tmp_path}") as e:
        turns_from_run(tmp_path)
    assert message in str(e.value)


def test_metrics_lines_without_a_calls_dict_are_skipped(tmp_path):
    from realloc.envs.turn_profile import turns_from_run

    (tmp_path / "samples.jsonl").write_text(json.dumps({"turn_segments": [0, 3]}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"calls": ["x"]}) + "\n" + json.dumps(
        {"calls": {"gen": {"env_obs_s": 0.5, "env_obs_steps": 2}}}) + "\n")
    assert turns_from_run(tmp_path).step_s == 0.25


@pytest.mark.parametrize("forged", ['[1]', '"ok"', '{"ok": true, "value": 5}', '{"ok": false, "error": [1]}'])
def test_a_tool_that_forges_its_result_line_ends_as_an_observation_not_a_crash(forged):
    """The parent read the result line's JSON with .get and +: a list or a number in it raised in the worker,
    which would have stopped the run (a tool never should)."""
    from realloc.tools.sandbox import Sandbox, ToolLimits

    r = Sandbox(ToolLimits(wall_s=20.0)).run("tool_cases:forge_result", forged)
    assert isinstance(r.text, str) and r.status in ("crash", "error")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d))
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_tool_does_not_outlive_a_killed_worker(tmp_path):
    """The tool runs in a session of its own (so that its group can be killed as a whole); when its worker was
    killed (a failed run stops its workers with SIGKILL) nobody enforced its wall time, and a blocked tool lived on."""
    code = ("import sys; sys.path.insert(0, %r); from realloc.tools.sandbox import Sandbox, ToolLimits; "
            "Sandbox(ToolLimits(wall_s=600)).run('tool_cases:sleep_forever', '')" % os.path.dirname(__file__))
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not (tools := _children(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tools, "the tool never started"
        time.sleep(1.0)  # past the child's set-up (the parent-death signal is set before the tool is imported)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_running(t) for t in tools) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [t for t in tools if _running(t)]
    for t in left:
        os.kill(t, signal.SIGKILL)
    assert not left, "the tool outlived its killed worker"


def _tool_spec(env_args):
    import dataclasses

    from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
    from realloc.api import auto, experiment_spec

    @auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=32)
    @dataclasses.dataclass
    class ToolRollouts:
        @property
        def rpcs(self):
            return multiturn_rpcs("grpo", env={"env": "tools", "env_args": env_args, "max_turns": 2}, actor="tiny",
                                  n_samples=4)

    return experiment_spec(ToolRollouts)


@pytest.mark.parametrize("env_args, message", [
    ({"tools": ["nope"]}, "tool 'nope' must be a built-in name"),
    ({"tools": {"c": "no_such_module_q:fn"}}, "module 'no_such_module_q' cannot be found"),
    ({"tools": ["calculator"], "limits": {"wall_s": -1}}, "ToolLimits.wall_s must be a positive number"),
    ({"tools": ["calculator"], "toolz": 1}, "unknown key(s) 'toolz'; known: tools, field"),
    ({"tools": ["calculator"], "call_format": "xml"}, "call_format must be one of tags, chat"),
    ({"tools": ["calculator"], "rule": 5}, "rule must be 'exact_match'"),
    ({"tools": ["calculator"], "call_reward": "x"}, "call_reward must be a finite number"),
])
def test_bad_tool_env_args_are_one_error_when_the_graph_is_built(env_args, message):
    """The built-in environment's arguments were checked only when a worker made it, mid-run; `realloc show`
    (build_graph) said nothing."""
    with pytest.raises(ValueError, match=r"call 'actor_gen': interface_args\['env_args'\] of env 'tools': ") as e:
        build_graph(_tool_spec(env_args))
    assert message in str(e.value)
    build_graph(_tool_spec({"tools": {"calc": "calculator", "echo": "tool_cases:echo"}}))  # a module on the path


@pytest.mark.parametrize("changes, message", [
    ({"tail": {"actor_gen": (4,)}}, "tail entry 'actor_gen' must be (rows, instances), a dict of those or a "
                                    "TailMigration, got (4,)"),
    ({"tail": {"actor_gen": 4}}, "tail entry 'actor_gen' must be (rows, instances)"),
    ({"tail": {"actor_gen": (0, 1)}}, "field 'tail.actor_gen.rows': Input should be greater than or equal to 1"),
    ({"fused": [("actor_train",)]}, "each fused pair is (first call, second call), got ('actor_train',)"),
    ({"fused": ["actor_train"]}, "each fused pair is (first call, second call), got 'actor_train'"),
    ({"placements": {"actor_gen": ("localhost", 2, 1)}}, "the placement of call 'actor_gen' must be (mesh, dp, tp, "
                                                         "pp, n_mbs)"),
    ({"placements": {"actor_gen": ("localhost", 0, 1, 1, 1)}}, "field 'placements.actor_gen.dp': Input should be"),
    ({"staleness": -1}, "field 'staleness': Input should be greater than or equal to 0"),
])
def test_a_malformed_plan_by_hand_is_one_line_naming_the_entry(changes, message):
    """ExecutionPlan.by_hand raised IndexError/TypeError/KeyError, 'not enough values to unpack' or pydantic's
    multi-line report for malformed entries."""
    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))
    places = {n: ("localhost", 2, 1, 1, 1) for n in graph.spec.call_names} | changes.pop("placements", {})
    with pytest.raises(ValueError) as e:
        ExecutionPlan.by_hand(graph, places, **changes)
    assert type(e.value) is ValueError and "\n" not in str(e.value)
    assert str(e.value).startswith("ExecutionPlan.by_hand: ") and message in str(e.value)


def test_by_hand_takes_dicts_and_lists_as_well():
    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))
    places = {n: ("localhost", 2, 1, 1, 1) for n in graph.spec.call_names}
    want = ExecutionPlan.by_hand(graph, places, recompute=["actor_train"], fused=[("actor_train", "critic_train")],
                                 tail={"actor_gen": (4, 1)})
    places["actor_train"] = {"mesh": "localhost", "dp": 2, "tp": 1, "pp": 1, "n_mbs": 1}
    got = ExecutionPlan.by_hand(graph, places, recompute=["actor_train"], fused=[["actor_train", "critic_train"]],
                                tail={"actor_gen": {"rows": 4, "instances": 1}})
    assert got == want and got.placements["actor_train"].recompute


@pytest.mark.parametrize("record", [{"seq": [1], "response_ids": [1, 2]}, {"iteration": {}, "response_ids": [1, 2]}])
def test_lengths_from_a_hand_edited_samples_file_do_not_raise_type_errors(tmp_path, record):
    """A list or an object in a sample's iteration/seq field made the dedup key unhashable (TypeError)."""
    from realloc.lengths import ResponseLengths, lengths_from_run

    (tmp_path / "samples.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    assert lengths_from_run(tmp_path) == ResponseLengths.empirical([2])


def test_a_tool_process_killed_mid_call_is_a_crash_observation_and_the_rollout_goes_on():
    from realloc.envs.tool_env import ToolEnv

    env = ToolEnv(tools={"k": "tool_cases:killed", "calc": "calculator"}, limits={"wall_s": 20.0})
    env.reset({"answer": "6"})
    obs, reward, done = env.step("<k>x</k>")
    assert not done and obs.startswith("<result>working") and "ended without a result (killed by SIGKILL)" in obs
    assert env.step("<calc>2*3</calc>")[0] == "<result>6</result>"
    assert env.tool_counts["crash"] == 1 and env.tool_counts["ok"] == 1


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """ENOSPC while the next checkpoint (carried partial rows, a shard with the fp16 loss scale) is committed: the
    previous one stays the newest, its files verify, and the next save clears the half-written one."""
    import errno

    from realloc.runtime.persist import checkpoint

    def save(it: int) -> Path:
        tmp = checkpoint.begin(root, it)
        (tmp / "partial/actor_gen").mkdir(parents=True)
        checkpoint.write_file_durably(tmp / "partial/actor_gen/0-4.json", json.dumps({"it": it}).encode())
        (tmp / "models/actor").mkdir(parents=True)
        checkpoint.write_file_durably(tmp / "models/actor/tp0_pp0.safetensors", b"loss_scale %d" % it)
        return checkpoint.commit(tmp, root, it, {"next_iteration": it}, "{}")

    root = tmp_path / "checkpoints"
    first = save(1)
    real = checkpoint.write_file_durably

    def full(path, data):
        if path.name == checkpoint.META:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(checkpoint, "write_file_durably", full)
    with pytest.raises(OSError, match="No space left"):
        save(2)
    assert checkpoint.latest(root) == first
    checkpoint.check_files(first)
    assert json.loads((first / "partial/actor_gen/0-4.json").read_text()) == {"it": 1}
    monkeypatch.setattr(checkpoint, "write_file_durably", real)
    assert save(3).name == "iter_00000003" and not list(root.glob(".tmp-*"))


def test_partial_rollouts_of_a_multiturn_generation_are_refused_at_show(capsys):
    """Partial rollouts cut a generation that runs once (common.actor_generate); a multi-turn rollout passed
    `realloc show` and failed in the worker at the run's first generation."""
    args = ["show", "experiments/calc_grpo_tool.py", "--set", "grpo.partial_rollout_tokens=4", "--set", "max_staleness=1"]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    want = "call 'actor_gen' has partial_rollout_tokens set, but interface 'grpo_multiturn' generates turn by turn"
    assert len(err) == 1 and want in err[0], err


def test_show_refuses_offloading_a_trained_model(tmp_path, capsys):
    """Only `realloc run` (Master) refused a plan that offloads a trained model; `realloc show --plan` said valid."""
    path = plan_file(tmp_path, "ppo_tiny", ("localhost", 2, 1, 1, 1), offload={"ref": True, "critic": True})
    assert main(["show", "experiments/ppo_tiny.py", "--plan", path]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == ("realloc show: error: plan offloads model 'critic', but it is trained; "
                                               "only frozen models can be offloaded between calls (its optimizer "
                                               "state never moves)")
    path = plan_file(tmp_path, "ppo_tiny", ("localhost", 2, 1, 1, 1), offload={"ref": True})
    assert main(["show", "experiments/ppo_tiny.py", "--plan", path]) == 0


def test_hand_edited_fused_pass_lines_do_not_stop_the_timeline(tmp_path):
    """`realloc trace` read fused_passes/worker<r>.jsonl lines by key and position: a JSON line of another shape
    ended the command in an internal error (KeyError), where a half-written line was already skipped."""
    from realloc.runtime.records.fused_passes import PASSES_DIR, with_passes

    (tmp_path / PASSES_DIR).mkdir()
    good = {"req": 3, "iteration": 1, "calls": ["a_train", "b_train"], "passes": [[0, 1, 0, 2, 0.5, 0.75]]}
    lines = [{}, [1], {"req": 3, "iteration": 1, "calls": ["a_train"], "passes": [[0, 0]]},
             {"req": 3, "iteration": 1, "calls": ["a_train", "b_train"], "passes": [[0, 5, 0, 0, 0.1, 0.2], "x"]},
             good]
    (tmp_path / PASSES_DIR / "worker0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"req": 3,')
    requests = [{"req": 3, "iteration": 1, "kind": "call", "label": "a_train+b_train"}]
    rows = with_passes(requests, tmp_path)
    assert rows[0] == requests[0] and len(rows) == 2
    assert rows[1]["label"] == "b_train" and rows[1]["micro_batch"] == 2 and rows[1]["spans"] == {"0": [0.5, 0.75]}


def test_trace_reads_a_hand_edited_or_cut_run_directory_or_names_the_bad_line(tmp_path, capsys):
    """requests.jsonl lines of another shape, run.json not an object: internal errors (KeyError, AttributeError)
    before; a line that is not JSON gave json's message without the file."""
    from realloc.runtime.trace_cli import _records

    path = tmp_path / "requests.jsonl"
    path.write_text('[1]\nnull\n{"kind": "call"}\n\n{"req": 1, "ki')
    assert _records(path) == [{"kind": "call"}]  # the cut last line of a killed run is skipped too
    path.write_text('{"kind": "call"}\ngarbage{\n{}\n')
    with pytest.raises(ValueError, match=f"{path} line 2 is not JSON"):
        _records(path)
    run = tmp_path / "run"
    (run).mkdir()
    ExecutionPlan.by_hand(build_graph(load_experiment("experiments/ppo_tiny.py")),
                          {"actor_gen": ("localhost", 2, 1, 1, 1)} | {c: ("localhost", 2, 1, 1, 1) for c in
                          ("rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")}).save(run / "plan.json")
    (run / "requests.jsonl").write_text('[1]\n')
    (run / "run.json").write_text("[1]")
    assert main(["trace", str(run), "--timeline", str(tmp_path / "t.html")]) == EXIT_USAGE
    assert "has no run.json naming its experiment; pass --experiment EXP" in capsys.readouterr().err


def test_a_plan_made_for_another_device_kind_is_one_error():
    """A plan searched for one device kind (its memory check, its prices) is refused on another, naming the field."""
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan, validate_plan
    from realloc.search import baseline

    graph = build_graph(load_experiment("experiments/ppo_tiny.py"))
    plan = baseline(graph.spec, "heuristic")
    validate_plan(plan, graph)
    other = ExecutionPlan.model_validate({**plan.model_dump(), "device": "h100-80g"})
    with pytest.raises(ValueError, match=r"plan field 'device'.*'h100-80g'.*runs on 'cpu'"):
        validate_plan(other, graph)
