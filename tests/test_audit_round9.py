"""Audit, ninth round (audit5): multi-turn rollouts, tools, the sandbox and environments at run time. Each test
failed before its fix, but the multi-turn LoRA resume, which checks what held (a whole checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from run_helpers import hash_seeded_cli
from safetensors import safe_open

from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.overrides import load_with_overrides
from realloc.tools.sandbox import Sandbox, ToolLimits, file_isolation, landlock_abi, network_isolation
from tests.test_multiturn_breadth_e2e import LORA
from tests.test_tool_sandbox import _leftovers

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("how, status", [("return", "ok"), ("hang", "timeout")])
def test_a_daemon_a_tool_starts_in_a_session_of_its_own_dies_with_the_call(how, status):
    # A fork + setsid + fork daemon left the tool's process group, so the group kill at the end of the call missed
    # it: it outlived the call (and the run), and as `nobody` counted against every later call's process limit.
    r = Sandbox(ToolLimits(wall_s=3.0, max_procs=8), network_isolation()).run("audit9_cases:daemon", how)
    assert r.status == status
    deadline = time.monotonic() + 5.0
    while _leftovers() and time.monotonic() < deadline:  # SIGKILLed, at most still leaving /proc
        time.sleep(0.05)
    assert _leftovers() == []


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_daemon_of_a_tool_dies_with_a_killed_worker(tmp_path):
    # The tool's process died with its worker (parent-death signal), but its daemon, in a session of its own,
    # lived on; now the keeper gets SIGTERM when the worker dies and ends every process of the tool first.
    code = ("import sys; sys.path.insert(0, %r); from realloc.tools.sandbox import Sandbox, ToolLimits; "
            "Sandbox(ToolLimits(wall_s=600)).run('audit9_cases:daemon', 'hang')" % os.path.dirname(__file__))
    worker = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while len(_leftovers()) < 3 and time.monotonic() < deadline:  # the keeper, the tool and its daemon
            time.sleep(0.1)
        assert len(_leftovers()) >= 3, "the daemon never started"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 10
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _leftovers()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert left == []


# -- a multi-turn run resumed mid-run ----------------------------------------------------------------------------
def _mt_run(tmp: Path, name: str, source: str, placements: dict, iterations: int, extra: tuple[str, ...] = (),
            plan_name: str | None = None, hash_seeds: tuple[int, ...] = (1, 2)) -> list[dict]:
    """``tests/test_multiturn_breadth_e2e._run`` with extra options and a plan shared between runs; worker r runs
    under PYTHONHASHSEED=hash_seeds[r]."""
    experiment = tmp / "experiment.py"
    experiment.write_text(source)
    plan = tmp / f"{plan_name or name}.json"
    if not plan.exists():
        graph = build_graph(load_with_overrides(str(experiment), []))
        ExecutionPlan.by_hand(graph, {c: placements.get(c, placements["*"]) for c in graph.topo_order}).save(plan)
    cmd = [*hash_seeded_cli(hash_seeds), "run", str(experiment), "--plan", str(plan),
           "--iterations", str(iterations), "--run-dir", str(tmp / name), "--quiet", *extra]
    path = f"{REPO}{os.pathsep}{REPO / 'tests'}"  # the workers import the environment from tests/multiturn_cases.py
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": path})
    assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _files(ckpt: Path) -> dict[str, object]:
    """Every tensor of a checkpoint's safetensors files (weights, adapters, Adam's moments and steps, ...) and every
    other file's bytes (RNG states, the data position, ...), by path."""
    out: dict[str, object] = {}
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = str(f.relative_to(ckpt))
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as h:
                out.update({f"{rel}/{k}": h.get_tensor(k) for k in h.keys()})
        else:
            out[rel] = f.read_bytes()
    return out


def test_a_multiturn_lora_grpo_run_resumed_mid_run_is_the_straight_run_whole_checkpoint(tmp_path):
    # LoRA adapters, their Adam moments and steps, the RNG states and the data position. (One step ahead, η = 1, a
    # resumed run generates its first iterations from the resumed parameters by design, docs/async-rl.md, so it
    # is not the straight run: checked to follow that rule, not compared.)
    split = {"*": ("localhost:1", 1, 1, 1, 1), "actor_gen": ("localhost:0", 1, 1, 1, 1)}
    source = LORA.replace("max_staleness=1", "max_staleness=0")
    _mt_run(tmp_path, "straight", source, split, 3, extra=("--save-every", "1", "--keep-checkpoints", "0"))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints/iter_00000003")
    _mt_run(tmp_path, "resumed", source, split, 3, extra=("--resume", str(resumed / "checkpoints/iter_00000002")),
            plan_name="straight", hash_seeds=(3, 4))  # other hash seeds than the straight run's
    want, got = (_files(run / "checkpoints/iter_00000003") for run in (straight, resumed))
    assert sorted(got) == sorted(want) and any("exp_avg_sq" in k for k in want) and "rng/rank0.safetensors/" \
        in "".join(want)
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            assert torch.equal(got[k], w), (k, (got[k].float() - w.float()).abs().max().item())
        elif k == "meta.json":  # its run id is each run's own; its files' digests are compared above, byte by byte
            a, b = (json.loads(x) for x in (w, got[k]))
            assert {**a, "run_id": None, "files": None} == {**b, "run_id": None, "files": None}
        else:
            assert got[k] == w, k


# -- what an environment answers ---------------------------------------------------------------------------------
def test_an_environment_s_answers_of_the_wrong_kind_are_one_error_naming_it():
    from realloc.envs.base import check_step

    # bool("False") is True and float("1") is 1.0: both were taken silently
    with pytest.raises(ValueError, match="env: step\\(\\)'s done must be True or False, got 'False'"):
        check_step("env", ("obs", 1.0, "False"))
    with pytest.raises(ValueError, match="env: step\\(\\)'s reward must be a number, got '1'"):
        check_step("env", (None, "1", True))
    # a lone surrogate: the tokenizer's TypeError ("TextEncodeInput must be Union[...]"), naming nothing
    with pytest.raises(ValueError, match="env: step\\(\\)'s observation is not valid text.*errors='replace'"):
        check_step("env", (b"\xff".decode("utf-8", errors="surrogateescape"), 0.0, False))
    assert check_step("env", ("<\x00>", 1, False)) == ("<\x00>", 1.0, False)  # NUL is text
    np = pytest.importorskip("numpy")
    assert check_step("env", (None, np.float32(0.5), np.bool_(True))) == (None, 0.5, True)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Two gloo ranks and the multi-turn tests' tokenizer (tests/test_multiturn.py), for tp 2 rollouts."""
    from mp_pool import GlooPool
    from tests.test_multiturn import CHARACTERS

    from realloc.demo.arith_task import train_tokenizer

    tok = str(train_tokenizer(tmp_path_factory.mktemp("tok"), CHARACTERS))
    with GlooPool(2, tmp_path_factory.mktemp("gloo")) as pool:
        yield pool, tok


def _error_with(ctx, tokenizer_dir: str, env: str) -> str | None:
    from tests.test_multiturn import ENV, _generate

    try:
        _generate(ctx, tokenizer_dir, 1, 2, 1, {**ENV, "env": env})
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def test_an_observation_that_is_not_text_stops_every_rank_of_the_replica_naming_the_environment(tp2):
    # tp 2: the reporting rank raised UnicodeEncodeError while packing the answers for the broadcast, outside the
    # environment's error path, and the other rank waited in the broadcast for ever
    pool, tok = tp2
    errors = pool.run(_error_with, tok, "audit9_cases:make_surrogate", timeout=120)
    assert errors[0].startswith("ValueError: call 'actor_gen': step()'s observation is not valid text")
    assert errors[1].startswith("ValueError: the environment raised on the replica's reporting rank")


def test_a_factory_that_makes_no_environment_is_one_error_naming_it(tp2):
    # "AttributeError: 'dict' object has no attribute 'reset'", from inside the rollout
    pool, tok = tp2
    errors = pool.run(_error_with, tok, "audit9_cases:make_dict", timeout=120)
    assert errors[0].startswith("ValueError: call 'actor_gen': interface_args['env'] 'audit9_cases:make_dict' made "
                                "a dict, which has no reset() and no step(); an environment has reset(record)")
    assert errors[1].startswith("ValueError: the environment raised on the replica's reporting rank")


def test_a_policy_s_tool_call_nested_too_deeply_or_carrying_a_lone_surrogate_is_an_observation():
    # "[[[[..." raised RecursionError out of json.loads, and a "\ud800" the tool echoed came back as a lone
    # surrogate: either stopped the run, though both are the policy's own text
    from realloc.envs.base import check_step
    from realloc.envs.tool_env import ToolEnv

    env = ToolEnv(tools={"echo": "tool_cases:echo"}, call_format="chat", limits={"wall_s": 20.0})
    obs, reward, done = check_step("env", env.step("<tool_call>" + "[" * 100_000 + "</tool_call>"))
    assert (obs, done) == ("<result>error: the tool call is not JSON (nested too deeply)</result>", False)
    obs, reward, done = check_step("env", env.step('<tool_call>{"name": "echo", "arguments": "a\\ud800b"}'
                                                   '</tool_call>'))
    assert (obs, done) == ("<result>printed A?B</result>", False)


@pytest.mark.skipif(not file_isolation(), reason="this kernel has no Landlock")
def test_a_tool_reads_no_file_of_the_run_but_those_it_is_given():
    # As `nobody` (or as the user) a python tool read whatever was world-readable: the training data with the
    # answers its reward checks (the calc demo's calc_train.jsonl), checkpoints, other runs' records
    with tempfile.TemporaryDirectory() as folder:  # where the tools' own folders are: `nobody` reaches it
        os.chmod(folder, 0o755)
        _reads_only_what_it_is_given(Path(folder))


def _reads_only_what_it_is_given(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    data.chmod(0o644)
    program = f"print(open({str(data)!r}).read())"
    r = Sandbox(ToolLimits(wall_s=20.0), network_isolation()).run("realloc.tools.builtin:python", program)
    assert (r.status, r.text) == ("error", f"error: PermissionError: [Errno 13] Permission denied: '{data}'")
    # its working directory, the Python it runs on (a module imported only now) and what read_paths names
    r = Sandbox(ToolLimits(wall_s=20.0, read_paths=[str(tmp_path)]), network_isolation()).run(
        "realloc.tools.builtin:python", "import textwrap; open('x', 'w').write('y'); print(open('x').read(), "
        f"textwrap.dedent(' z')); {program}")
    assert (r.status, r.text) == ("ok", 'y z\n{"prompt": "2+2=", "answer": "4"}\n\n')
    with pytest.raises(ValueError, match="ToolLimits.read_paths must be a list of absolute paths, got 'data'"):
        ToolLimits(read_paths="data")
    # /dev/null, not the rest of /dev: /dev/shm holds shared memory of the worker's (torch's, gloo's) in its files
    if os.path.isdir("/dev/shm"):
        with tempfile.NamedTemporaryFile("w", dir="/dev/shm", prefix="realloc-audit9-") as f:
            f.write("kept")
            f.flush()
            os.chmod(f.name, 0o666)  # what a file of the worker's user is to a tool that runs as that user
            # 'r+': no O_CREAT, which fs.protected_regular refuses in a sticky folder whatever the sandbox does
            program = f"import os; open(os.devnull, 'w').write('-'); open({f.name!r}, 'r+').write('changed')"
            r = Sandbox(ToolLimits(wall_s=20.0), network_isolation()).run("realloc.tools.builtin:python", program)
            assert (r.status, r.text) == ("error", f"error: PermissionError: [Errno 13] Permission denied: '{f.name}'")
            assert Path(f.name).read_text() == "kept"


@pytest.mark.skipif(landlock_abi() < 6 or os.geteuid() != 0,
                    reason="signals are scoped from Landlock ABI 6; as a user, a failure would kill this test's runner")
def test_a_tools_kill_of_every_process_reaches_only_its_own():
    # kill(-1, SIGKILL) from a tool (one line of a policy's python program) killed every process of its user: as
    # `nobody` the other rollouts' tools (and other runs'), as the trainer's user the worker and the master too
    victim = subprocess.Popen(["sleep", "60"], user=65534)  # a process of the tool's user, not the tool's
    try:
        r = Sandbox(ToolLimits(wall_s=20.0), network_isolation()).run("audit9_cases:kill_all", "")
        assert (r.status, r.text) == ("ok", "still here")
        time.sleep(0.3)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_lengths_from_a_run_of_more_turns_than_max_turns_names_the_option(tmp_path):
    # "call 'actor_gen': interface_args['turn_profile'] has 2 turns but max_turns is 1": a key the user never wrote
    from realloc.search.turns_report import turns_from

    experiment = tmp_path / "experiment.py"
    experiment.write_text(LORA.replace('"max_turns": 2', '"max_turns": 1'))
    run = tmp_path / "run"
    run.mkdir()
    (run / "samples.jsonl").write_text(json.dumps({"iteration": 1, "turn_segments": [1, 3, 2, 3]}) + "\n")
    with pytest.raises(ValueError, match=f"^--lengths-from {run}: its rollouts took up to 2 turns, but call "
                                         f"'actor_gen' allows max_turns=1; take the lengths"):
        turns_from(load_with_overrides(str(experiment), []), run)


def test_a_result_format_with_other_braces_is_refused_when_the_graph_is_built():
    # '{"result": "{}"}' passed the check (it holds {}) and raised KeyError('"result"') at the first tool call
    from realloc.envs.tool_env import ToolEnv, check_env_args

    with pytest.raises(ValueError, match="^call 'actor_gen': interface_args\\['env_args'\\] of env 'tools': "
                                         "result_format '\\{\"result\": \"\\{\\}\"\\}' cannot be filled in "
                                         "\\(KeyError: '\"result\"'\\); give it one \\{\\} where the answer goes"):
        check_env_args("actor_gen", {"result_format": '{"result": "{}"}'})
    env = ToolEnv(result_format='{{"result": "{}"}}', limits={"wall_s": 20.0})
    assert env.step("<calculator>2+2</calculator>") == ('{"result": "4"}', 0.0, False)


@pytest.mark.parametrize("which", ["dataset", "eval"])
def test_a_record_without_the_field_the_tools_environment_scores_against_is_refused_before_the_run(tmp_path, capsys,
                                                                                                  which):
    # ToolEnv.reset raised when such a record's prompt came up: at whatever iteration drew it, or at the first
    # evaluation (every=25: after 25 iterations of training)
    from realloc.cli import main

    good = [{"prompt": f"{i}*3=", "answer": str(3 * i)} for i in range(8)]
    bad = good[:5] + [{"prompt": "7*3="}] + good[6:]
    for name, rows in (("good.jsonl", good), ("bad.jsonl", bad)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = LORA.replace('"env": "multiturn_cases:make_env", "env_args": {"turns": 2, "tool": True}',
                          '"env": "tools", "env_args": {"tools": ["calculator"]}')
    source = source.replace("max_staleness=1", "max_staleness=0").replace(
        'DATA + "/calc_train.jsonl"', repr(str(tmp_path / ("bad.jsonl" if which == "dataset" else "good.jsonl"))))
    source = source.replace("    sample_every: int = 1\n", "    sample_every: int = 1\n    eval: EvalConfig = "
                            f"EvalConfig(dataset={str(tmp_path / 'bad.jsonl')!r}, every=25, batches=1)\n"
                            if which == "eval" else "    sample_every: int = 1\n")
    source = "from realloc.runtime.inputs.evaluation import EvalConfig\n" + source
    assert '"env": "tools"' in source and ("EvalConfig(dataset" in source) == (which == "eval")
    (tmp_path / "exp.py").write_text(source)
    assert main(["show", str(tmp_path / "exp.py")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"realloc show: error: dataset {tmp_path / 'bad.jsonl'}: 1 of 8 records have no field 'answer', "
                   f"which call 'actor_gen''s tools environment scores the answer against (env_args['field']); "
                   f"fields: 'answer'"]

