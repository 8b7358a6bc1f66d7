"""Audit, round 5: a new user's runs of the last rounds' features. Each test failed before its fix."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from realloc.cli import main
from realloc.runtime.records.run_claim import LOCK_NAME, claim_run_dir

REPO = Path(__file__).resolve().parents[1]
GRPO = str(REPO / "experiments/grpo_tiny.py")
PLAN = {n: ("localhost", 2, 1, 1, 1) for n in ("actor_gen", "rew_inf", "ref_inf", "actor_train")}


def _plan(tmp_path: Path) -> str:
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan

    path = tmp_path / "plan.json"
    path.write_text(ExecutionPlan.by_hand(build_graph(load_experiment(GRPO)), PLAN).to_json())
    return str(path)


def test_a_second_run_on_a_live_run_directory_is_one_error_and_the_first_run_is_untouched(tmp_path, capsys):
    """Two `realloc run`s on one directory: the second overwrote the first's secret (its workers were then
    refused a CURVE handshake and the first run died), and truncated its metrics. Now the second is one line
    naming the first's pid, and the first runs to its end."""
    run_dir, plan = tmp_path / "run", _plan(tmp_path)
    first = subprocess.Popen([sys.executable, "-m", "realloc", "run", GRPO, "--plan", plan, "--iterations", "6",
                              "--run-dir", str(run_dir), "--no-tensorboard"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "plan.json").exists():  # the first run has claimed the directory and prepared it
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()
            time.sleep(0.05)
        assert main(["run", GRPO, "--plan", plan, "--iterations", "6", "--run-dir", str(run_dir)]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "in use by another `realloc run`" in err and f"pid {first.pid}" in err and "--run-dir" in err
        out = first.communicate(timeout=300)[0].decode()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == list(range(1, 7))
    # The lock dies with its run: the same directory is free again (a resume or a later run may use it).
    os.close(claim_run_dir(run_dir, True, False)[2])


def test_a_claimed_directory_refuses_a_second_claim_until_released(tmp_path):
    root = tmp_path / "a" / "run"
    path, created, fd = claim_run_dir(root, True, default_name=False)
    assert (path, created) == (root, tmp_path / "a") and (root / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    with pytest.raises(ValueError, match=rf"run directory {root} is in use by another `realloc run` \(pid "
                                         rf"{os.getpid()}\); wait for it to end, or pass --run-dir another folder"):
        claim_run_dir(root, True, default_name=False)
    assert root.is_dir()  # the refused claim removed nothing of the holder's
    os.close(fd)
    os.close(claim_run_dir(root, True, default_name=False)[2])


def test_two_peers_in_the_same_second_get_their_own_default_run_directories(tmp_path):
    """The default run directory is runs/<experiment>-<time to the second>: two peers that start the same
    experiment in the same second shared it. The second now takes a suffix."""
    root = tmp_path / "runs" / "grpo_tiny-20261128-182350"
    a, created_a, fd_a = claim_run_dir(root, True, default_name=True)
    b, created_b, fd_b = claim_run_dir(root, True, default_name=True)
    assert (a, b) == (root, root.with_name(root.name + "-2"))
    assert created_a == tmp_path / "runs" and created_b == b
    os.close(fd_a)
    os.close(fd_b)


def test_saving_a_plan_leaves_a_peers_half_written_file_alone(tmp_path):
    """`realloc search --out plan.json` (and a profile's save, the same helper) wrote through the fixed name
    plan.json.tmp: a peer saving the same file at once truncated it under the other, whose rename then failed or
    published a mix."""
    from realloc.graph.plan import ExecutionPlan

    plan = ExecutionPlan.load(_plan(tmp_path))
    out = tmp_path / "out.json"
    peer = tmp_path / "out.json.tmp"  # the name the old save used: a peer's file, mid-write
    peer.write_text('{"half": ')
    plan.save(out)
    assert peer.read_text() == '{"half": ' and ExecutionPlan.load(out) == plan
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "out.json.tmp", "plan.json"]


def test_two_exports_to_one_folder_at_once_leave_one_whole_export(tmp_path, monkeypatch):
    """Two `realloc export --out DIR` at once: the second deleted the first's half-written .DIR.part and wrote
    there; the first then failed on a missing file (a traceback), or renamed the second's partial files into
    DIR. Here a whole peer export lands while this one writes: this one is one error, the peer's stays whole."""
    from test_export import CFG, _fake_checkpoint
    from transformers import AutoModelForCausalLM

    from realloc.runtime.persist import export

    ckpt, _ = _fake_checkpoint(tmp_path / "run", CFG, 1, 1, iteration=1, seed=1)
    out = tmp_path / "new" / "hf"
    copy = export._copy_tokenizer
    peers = []

    def peer_exports_meanwhile(where, tokenizer):
        if not peers:
            peers.append("running")
            peers[0] = export.export_checkpoint(ckpt, "actor", out)
        copy(where, tokenizer)

    monkeypatch.setattr(export, "_copy_tokenizer", peer_exports_meanwhile)
    with pytest.raises(ValueError, match=rf"^export directory {out} was filled while exporting \(another export "
                                         rf"to it\?\); choose a new --out$"):
        export.export_checkpoint(ckpt, "actor", out)
    assert peers == [out] and sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no half export left
    AutoModelForCausalLM.from_pretrained(out)


def test_a_searched_plan_edited_by_hand_loses_the_estimates_of_the_plan_before_the_edit(tmp_path, capsys):
    """docs/streaming.md says to take `realloc search --out plan.json` and edit it. `realloc run` then printed the
    search's per-call estimates, estimated time and memory warning for placements the plan no longer has."""
    from realloc.graph.plan import ExecutionPlan

    searched = ExecutionPlan.load(_plan(tmp_path)).model_copy(update=dict(
        source="search", estimated_time=0.5, estimated_peak_memory=2**20, call_times={c: 0.1 for c in PLAN},
        call_memory={c: 2**20 for c in PLAN}))
    path = tmp_path / "searched.json"
    searched.save(path)
    assert ExecutionPlan.load(path) == searched  # as saved: the estimates are its own
    raw = json.loads(path.read_text())
    raw["placements"]["actor_train"].update(mesh="localhost:1", dp=1)
    path.write_text(json.dumps(raw, indent=4))
    edited = ExecutionPlan.load(path)
    assert edited.placements["actor_train"].mesh == "localhost:1" and edited.source == "edited after its search"
    assert (edited.estimated_time, edited.estimated_peak_memory, edited.call_times, edited.call_memory) == \
        (None, None, {}, {})
    assert "estimated time" not in edited.table() and "0.100" not in edited.table()
    assert main(["show", GRPO, "--plan", str(path)]) == 0
    assert f"plan       {path}: valid (edited after its search: its estimates, made for the plan before the edit, " \
           f"were dropped; `realloc trace` prices the plan that ran)" in capsys.readouterr().out
    raw["placements"]["actor_train"].update(mesh="localhost", dp=2)  # edited back: its estimates hold again
    path.write_text(json.dumps(raw))
    assert ExecutionPlan.load(path) == searched


def test_the_demo_does_not_delete_a_run_directory_a_live_run_holds(tmp_path, capsys):
    """`make demo` deleted runs/arith_demo before its run: a peer's demo running there lost its files mid-run
    (and the two runs then shared the directory). Now the second demo stops at once, in one line."""
    from realloc.demo import arith_demo

    root = tmp_path / "arith_demo"
    _, _, fd = claim_run_dir(root, True, default_name=False)  # a peer's live run
    (root / "metrics.jsonl").write_text("{}\n")
    try:
        assert arith_demo.main(["--run-dir", str(root)]) == 2
    finally:
        os.close(fd)
    assert capsys.readouterr().err == f"arith_demo: error: run directory {root} is in use by another `realloc run` " \
                                      f"(pid {os.getpid()}); wait for it to end, or pass --run-dir another folder\n"
    assert (root / "metrics.jsonl").read_text() == "{}\n"


def test_a_hanging_reward_service_fails_the_call_after_one_deadline_not_one_per_queued_request():
    """A call of more requests than `concurrency` sent every queued request after the first had failed, each
    waiting out its own deadline and retries: 16 requests at concurrency 1 took 16 deadlines, not the
    documented timeout x (retries + 1). Now the queued requests are not sent once one has failed."""
    from realloc.algorithms.rewards.remote_reward import RemoteReward, RewardServiceError
    from reward_service import Service

    with Service(slow=1000, delay=2.0) as svc:
        reward = RemoteReward.of("rew_inf", {"url": svc.url, "timeout": 0.3, "retries": 0, "concurrency": 1,
                                             "batch": 1})
        with pytest.raises(RewardServiceError, match=r"failed 1 time\(s\): no answer within timeout=0.3 s"):
            reward.score([[1]] * 16, [[2, 3]] * 16, [{}] * 16)
        assert svc.requests <= 2  # the failed one, and one its thread may have begun before the cancel


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has exited
    except FileNotFoundError:
        return False


def _stop_and_check_none_left(parent: subprocess.Popen, sig: int, find, n: int) -> None:
    """Wait until ``find()`` lists ``n`` processes started under ``parent``, send ``parent`` ``sig``, and check
    that every one of them ends (each left over is killed after the check)."""
    import signal

    procs: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(procs) < n:
            assert parent.poll() is None and time.monotonic() < deadline
            procs = find()
            time.sleep(0.1)
        parent.send_signal(sig)
        parent.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(map(_alive, procs)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, procs))
    finally:
        for pid in [parent.pid, *procs]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _measuring(pid: int) -> list[int]:
    """``realloc profile``'s measuring processes: its children but multiprocessing's resource tracker."""
    return [c for c in _children(pid) if _alive(c) and "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_realloc_profile_stopped_by_sigterm_leaves_no_worker_measuring(tmp_path):
    """`realloc profile` started its measuring processes as daemons, which only a clean exit stops: a SIGTERM
    (a timeout, a batch system) or SIGKILL left them running, orphaned, for the rest of the profile."""
    import signal

    cmd = [sys.executable, "-m", "realloc", "profile", "--model", "tiny", "--tp", "1,2", "--quiet",
           "--out", str(tmp_path / "p.json")]
    parent = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _stop_and_check_none_left(parent, signal.SIGTERM, lambda: _measuring(parent.pid), 2)  # tp 2: two processes


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_killed_demo_leaves_no_realloc_command_running(tmp_path):
    """The demos run each `realloc` command as a child process; a demo killed by SIGKILL or SIGTERM left that
    child (a `realloc run` with its workers, minutes of the calc demo) running on. Here the child is a profile."""
    import signal

    code = ("import sys; from realloc.demo.arith_demo import _realloc; "
            "_realloc(['profile', '--model', 'tiny', '--tp', '1,2', '--quiet', '--out', sys.argv[1]])")
    demo = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "p.json")],
                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    # the realloc command and its two measuring processes
    _stop_and_check_none_left(demo, signal.SIGKILL,
                              lambda: [p for c in _children(demo.pid) for p in (c, *_measuring(c))], 3)


def test_no_fused_pairs_is_not_ignored_for_a_plan_that_fuses(tmp_path, capsys):
    """`realloc run --no-fused-pairs` (the opt-out while NCCL's fused pairs are unproven on GPUs) only shaped the
    search: with --plan (or --resume) of a plan that fuses, the run fused anyway, silently."""
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan

    ppo = str(REPO / "experiments/ppo_tiny.py")
    graph = build_graph(load_experiment(ppo))
    path = tmp_path / "fused.json"
    ExecutionPlan.by_hand(graph, {c: ("localhost", 1, 1, 2, 2) for c in graph.spec.call_names},
                          fused=[("actor_train", "critic_train")]).save(path)
    run_dir = tmp_path / "run"
    assert main(["run", ppo, "--plan", str(path), "--no-fused-pairs", "--iterations", "1",
                 "--run-dir", str(run_dir)]) != 0
    assert capsys.readouterr().err == (f"realloc run: error: --no-fused-pairs: the plan file {path} fuses "
                                       f"actor_train + critic_train; remove its \"fused\" entry (or pass --plan a "
                                       f"plan without one)\n")
    assert not run_dir.exists()


def test_a_filesystem_without_locks_runs_unguarded_rather_than_not_at_all(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    root, _, fd = claim_run_dir(tmp_path / "run", True, default_name=False)
    assert root.is_dir() and fd is not None
    os.close(fd)


def test_a_job_master_waits_for_the_lock_of_a_master_that_is_going_away(tmp_path):
    """A requeued SLURM job's master (--launcher external) meets the lock of the job's previous master until the
    shared filesystem frees it: it waits (run_claim.LOCK_WAIT_S) instead of failing the requeued job."""
    import threading

    root = tmp_path / "run"
    _, _, held = claim_run_dir(root, True, default_name=False)
    threading.Timer(1.5, os.close, (held,)).start()
    _, _, fd = claim_run_dir(root, True, default_name=False, wait_s=60)
    os.close(fd)


def test_a_plan_saved_to_a_device_or_a_folder_neither_replaces_it_nor_names_a_temporary_file(tmp_path, capsys):
    """The atomic save renames a temporary file over the target: over /dev/stdout (or any device) that would
    replace the device itself, and for a folder the error named the temporary file. A device is written in place;
    `realloc search --out FOLDER` is one line before the search."""
    from realloc.graph.plan import ExecutionPlan

    plan = ExecutionPlan.load(_plan(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    plan.save(fifo)
    assert ExecutionPlan.from_json(reader.communicate(timeout=30)[0].decode()) == plan
    assert fifo.is_fifo()
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        plan.save(tmp_path)
    assert main(["search", GRPO, "--search-time", "0.1", "--out", str(tmp_path)]) != 0
    assert capsys.readouterr().err == f"realloc search: error: --out {tmp_path} is a folder; give a file name in it\n"


@pytest.mark.parametrize("argv, message", [
    (["search", GRPO, "--seed", "-1"], "realloc search: error: --seed must be from 0 to 2**63 - 1, got -1"),
    (["search", GRPO, "--threads", "100000"],
     "realloc search: error: --threads must be from 1 to 1024 (one MCMC chain each), got 100000"),
    (["search", GRPO, "--search-time", "inf"],
     "realloc search: error: --search-time must be a positive, finite number of seconds, got inf"),
    (["search", GRPO, "--search-time", "nan"],
     "realloc search: error: --search-time must be a positive, finite number of seconds, got nan"),
    (["run", GRPO, "--search-time", "nan", "--iterations", "1"],
     "realloc run: error: --search-time must be a positive, finite number of seconds, got nan"),
])
def test_search_settings_out_of_range_are_one_line(argv, message, capsys):
    """--seed -1 was a multi-line pybind TypeError; --threads 100000 spent the search starting threads and
    returned a plan after 0 evaluations; --search-time inf stopped at once; --search-time nan never stopped."""
    assert main(argv) != 0
    assert capsys.readouterr().err == message + "\n"


def test_the_engine_refuses_a_time_limit_that_never_runs_out():
    from realloc.search import search

    with pytest.raises(ValueError, match="time limit must be a positive, finite number of seconds, got nan"):
        search(GRPO, time_limit=float("nan"))
    with pytest.raises(ValueError, match=r"seed must be an integer from 0 to 2\*\*63 - 1, got -1"):
        search(GRPO, time_limit=1.0, seed=-1)


@pytest.mark.parametrize("experiment, setting, message", [
    ("grpo_tiny", "grpo.max_grad_norm=nan", "GRPOConfig.max_grad_norm must be positive (None: no clipping), got nan"),
    ("grpo_tiny", "grpo.max_grad_norm=-1", "GRPOConfig.max_grad_norm must be positive (None: no clipping), got -1.0"),
    ("grpo_tiny", "grpo.lr=inf", "GRPOConfig.lr must be finite, got inf"),
    ("grpo_tiny", "grpo.adam_eps=inf", "GRPOConfig.adam_eps must be finite, got inf"),
    ("grpo_tiny", "grpo.top_p=2", "GRPOConfig.top_p must be in (0, 1] (1: off), got 2.0"),
    ("grpo_tiny", "grpo.top_k=-1", "GRPOConfig.top_k must be an integer >= 0 (0: off), got -1"),
    ("ppo_tiny", "ppo.critic_lr=-1", "PPOConfig.critic_lr must be positive and finite, got -1.0"),
    ("ppo_tiny", "ppo.value_clip_eps=-0.2",
     "PPOConfig.value_clip_eps must be positive (inf: no value clipping), got -0.2"),
    ("ppo_tiny", "ppo.gamma=2", "PPOConfig.gamma must be in (0, 1], got 2.0"),
    ("ppo_tiny", "ppo.gae_lambda=nan", "PPOConfig.gae_lambda must be in [0, 1], got nan"),
])
def test_training_settings_that_would_ruin_the_run_in_silence_are_refused(experiment, setting, message, capsys):
    """Each was accepted: max_grad_norm nan made every parameter nan at the first step (the clip's factor),
    -1 turned the update around, lr inf; a negative critic_lr, an inverted value clamp, a gamma above 1; top_p 2
    and top_k -1 stopped the run at its first generation call."""
    assert main(["show", str(REPO / "experiments" / f"{experiment}.py"), "--set", setting]) != 0
    assert capsys.readouterr().err == f"realloc show: error: --set {setting.split('=')[0]}=...: {message}\n"


def test_max_grad_norm_none_clips_nothing():
    from realloc.algorithms.critic_free.grpo import GRPOConfig

    assert GRPOConfig(max_grad_norm=None).max_grad_norm is None
