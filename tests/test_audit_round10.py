"""Audit, round 10: a new user's audit of the core run path (hand-written plans, killed processes, full disks, slow
services, resume chains, a peer on the same task). Each test of a defect failed before its fix; its docstring says
what the user saw."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from run_helpers import REPO, TINY, disjoint_plan
from test_export import CFG, _fake_checkpoint


def _plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.json"
    disjoint_plan().save(path)
    return str(path)


def _on_first_shard(monkeypatch, action) -> None:
    """Run ``action`` once, when the export has read its first shard file and before it opens the second."""
    from realloc.runtime.persist import export

    real, done = export.safe_open, []

    def hooked(path, *args, **kwargs):
        if path.endswith("tp1_pp0.safetensors") and not done:
            done.append(True)
            action()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(export, "safe_open", hooked)


def test_a_fresh_run_sets_aside_a_checkpoint_an_export_is_reading_only_once_the_export_is_done(tmp_path, monkeypatch,
                                                                                               capsys):
    """`realloc export RUN` while a fresh `realloc run` starts in the same run directory: the run moved the
    checkpoint into checkpoints/replaced-*/ between the export's shard files, and the export failed with
    `checkpoint .../iter_00000002: shard models/actor/tp1_pp0.safetensors of model 'actor' is missing`, as if the
    checkpoint were damaged. Now the run waits for the export, then sets the checkpoint aside."""
    from realloc.cli import main
    from realloc.runtime.persist import checkpoint as C

    run = tmp_path / "run"
    ckpt, full = _fake_checkpoint(run, CFG, 2, 1, iteration=2)
    waiting, moved = threading.Event(), threading.Event()
    monkeypatch.setattr(C.log, "warning", lambda msg, *a: waiting.set() if msg.startswith("waiting for") else None)

    def fresh_run():
        C.set_aside_later(run / "checkpoints", 0)
        moved.set()

    def start_the_peer():
        threading.Thread(target=fresh_run, daemon=True).start()
        while not (waiting.is_set() or moved.is_set()):  # it moves the checkpoint at once, or waits for the export
            waiting.wait(0.01)

    _on_first_shard(monkeypatch, start_the_peer)
    out = tmp_path / "hf"
    rc = main(["export", str(run), "--model", "actor", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.startswith("exported actor after iteration 3 from "), captured.err
    assert moved.wait(30)
    (aside,) = (run / "checkpoints").glob("replaced-*")
    assert [p.name for p in aside.iterdir()] == [ckpt.name] and not ckpt.exists()
    got = load_file(out / "model.safetensors")
    for n, t in full.items():
        assert (got[n] == t).all(), n


def test_a_run_does_not_prune_a_checkpoint_an_export_is_reading(tmp_path, monkeypatch):
    """`realloc export RUN --iteration 1` while the run saves iteration 3 with --keep-checkpoints 1: the run deleted
    iter_00000001 between the export's shard files and the export failed naming a missing shard. The run now
    leaves it for its next save."""
    from realloc.runtime.persist import checkpoint as C
    from realloc.runtime.persist.export import export_checkpoint

    run = tmp_path / "run"
    old, full = _fake_checkpoint(run, CFG, 2, 1, iteration=1)
    newest, _ = _fake_checkpoint(run, CFG, 2, 1, iteration=3, seed=1)
    pruned = []
    _on_first_shard(monkeypatch, lambda: pruned.extend(C.prune(run / "checkpoints", newest, keep=1)))
    out = export_checkpoint(old, "actor", tmp_path / "hf")
    assert pruned == [] and old.is_dir()
    got = load_file(out / "model.safetensors")
    for n, t in full.items():
        assert (got[n] == t).all(), n
    assert C.prune(run / "checkpoints", newest, keep=1) == [old] and not old.exists()  # the next save


def test_an_export_that_opens_a_checkpoint_as_it_is_set_aside_says_where_it_went(tmp_path, monkeypatch):
    """The export opened meta.json a moment before the run moved the checkpoint: one line saying so."""
    import fcntl
    import types

    from realloc.runtime.persist import checkpoint as C
    from realloc.runtime.persist import ckpt_lock
    from realloc.runtime.persist.export import export_checkpoint

    run = tmp_path / "run"
    ckpt, _ = _fake_checkpoint(run, CFG, 1, 1, iteration=2)

    def flock(fd, op):
        if op == fcntl.LOCK_SH:  # the reader's lock, taken after the peer's move
            monkeypatch.setattr(ckpt_lock, "fcntl", fcntl)
            C.set_aside_later(run / "checkpoints", 0)
        fcntl.flock(fd, op)

    monkeypatch.setattr(ckpt_lock, "fcntl", types.SimpleNamespace(**{k: getattr(fcntl, k) for k in dir(fcntl)
                                                                     if k.startswith("LOCK_")}, flock=flock))
    with pytest.raises(ValueError, match=f"checkpoint {ckpt} was moved or deleted while it was being opened"):
        export_checkpoint(ckpt, "actor", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _raw_service(reply: bytes):
    """A service on loopback that reads each request and answers ``reply`` byte for byte, then closes; returns
    (url, the list of requests' numbers so far)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    seen: list[int] = []

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(1 << 16)
                head, body = data.split(b"\r\n\r\n", 1)
                size = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length"))
                while len(body) < size:
                    body += conn.recv(1 << 16)
                seen.append(len(seen) + 1)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}/score", seen


def _answer(body: bytes, length: int | None = None) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body) if length is None else length, body)


@pytest.mark.parametrize("body, shown", [
    (b'{"scores": [NaN, 2.0]}', "the score nan for sequence 0"),
    (b'{"scores": [1.0, -Infinity]}', "the score -inf for sequence 1"),
    (b'{"scores": [1e999, 2.0]}', "the score inf for sequence 0"),
    (b'{"scores": [1' + b"0" * 400 + b', 2.0]}', "the score 1000000000"),
    (b"[" * 100_000 + b"]" * 100_000, "answered with something other than JSON"),
])
def test_a_reward_service_answering_what_is_no_score_is_one_error_naming_it(body, shown):
    """A service answering NaN or Infinity (JSON as Python writes it) had its scores taken; the run then stopped
    with `interface 'remote_reward' returned a non-finite score (nan)`, not naming the service. An integer past a
    float's range or arrays nested past the parser's depth stopped it with `OverflowError: int too large to convert
    to float` / `RecursionError: maximum recursion depth exceeded` and no word of the service."""
    from realloc.algorithms.rewards.remote_reward import RemoteReward, RewardServiceError

    url, seen = _raw_service(_answer(body))
    with pytest.raises(RewardServiceError) as e:
        RemoteReward(url=url, timeout=10, retries=2, backoff=0.01).score(["a", "b"], ["x", "y"], [{}, {}])
    assert str(e.value).startswith(f"reward service {url} answered ") and shown in str(e.value), e.value
    assert seen == [1]  # not tried again: the service answered, wrongly


@pytest.mark.parametrize("body", [b'{"scores": [1.0, ', b'{"scores": [1.0, 2.0]}'])
def test_a_reward_service_that_closes_the_connection_mid_reply_is_tried_again(body):
    """The service sent its headers and part of the body, then closed the connection (a crash, a proxy's reset):
    the client took the part as the whole answer, failed at once with `answered with something other than JSON`
    instead of trying again as for any other failed connection, or, when the part was whole JSON, took it."""
    from realloc.algorithms.rewards.remote_reward import RemoteReward, RewardServiceError

    url, seen = _raw_service(_answer(body, length=40))
    with pytest.raises(RewardServiceError) as e:
        RemoteReward(url=url, timeout=10, retries=2, backoff=0.01).score(["a", "b"], ["x", "y"], [{}, {}])
    assert f"failed 3 time(s): the connection closed after {len(body)} of the answer's 40 bytes" in str(e.value)
    assert seen == [1, 2, 3]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("full", ["config/experiment.json", "trace.json"])
def test_a_full_disk_under_a_runs_records_is_one_line_naming_the_file(tmp_path, full):
    """A run directory on a disk that fills up (a 4 MiB tmpfs, filled to 24 KiB or 64 KiB free): the run ended in
    `realloc run: error: No space left on device` before launching, or in `master: No space left on device` twice
    and then `the run's records could not be written after actor_train (iteration 1): No space left on device`,
    never naming the file. A buffered file's failed write, flush or close carries no file name. Here the file is
    a link to /dev/full, whose writes fail as a full disk's do."""
    run_dir = tmp_path / "run"
    (run_dir / full).parent.mkdir(parents=True)
    (run_dir / full).symlink_to("/dev/full")
    proc = subprocess.run([sys.executable, "-m", "realloc", "run", TINY, "--plan", _plan(tmp_path), "--iterations",
                           "2", "--no-final-checkpoint", "--run-dir", str(run_dir), "--quiet", "--no-tensorboard"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("realloc run: error: ") and err.endswith(f"{run_dir / full}: No space left on device"), err
    if full == "trace.json":
        assert "could not be written after" in err, err


def test_a_plan_of_another_experiment_with_the_same_calls_says_whose_it_is():
    """experiments/ppo_tiny.py's plan given to experiments/ppo_small.py (the same six calls on the same two
    devices): `plan was made for a different version of experiment 'SmallPPO'`, as if ppo_small.py had been
    edited, when the plan file is TinyPPO's."""
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import validate_plan

    small = build_graph(load_experiment(str(REPO / "experiments/ppo_small.py")))
    with pytest.raises(ValueError) as e:
        validate_plan(disjoint_plan(), small)
    assert str(e.value).startswith("plan was made for experiment 'TinyPPO', not 'SmallPPO' (graph digest "), e.value


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as a disk that cannot take the rewrite")
def test_a_resume_that_cannot_rewrite_its_records_keeps_the_history(tmp_path):
    """A resume drops the killed run's later lines of metrics.jsonl, samples.jsonl and requests.jsonl by rewriting
    each file in place: a full disk (or a kill) during the rewrite left them truncated, the history before the
    checkpoint lost. Here the rewrite is refused by a file-size limit below what is kept, as a full disk refuses
    it; the files must keep their old content, and the run's error names the file."""
    import json
    import textwrap

    lines = [json.dumps({"iteration": i, "reward": 0.25, "pad": "x" * 200}) for i in range(1, 6)]
    for name in ("metrics.jsonl", "samples.jsonl", "requests.jsonl"):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        from realloc.runtime.records.run_paths import RunPaths
        from realloc.runtime.records.telemetry import RequestLog
        from realloc.runtime import run_cli
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
        root = Path({str(tmp_path)!r})
        for rewrite in (lambda: run_cli._truncate_metrics(root / "metrics.jsonl", 3),
                        lambda: run_cli._drop_later_samples(RunPaths(root), 3),
                        lambda: RequestLog(root / "requests.jsonl", resume_after=3)):
            try:
                rewrite()
            except OSError as e:
                print(e.filename, e.strerror)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    names = ("metrics.jsonl", "samples.jsonl", "requests.jsonl")
    assert proc.stdout.splitlines() == [f"{tmp_path / name} File too large" for name in names], proc.stdout + proc.stderr
    for name in names:
        assert (tmp_path / name).read_text() == "".join(line + "\n" for line in lines), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # no temporary file left


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as a full disk")
def test_a_full_disk_at_the_runs_secret_its_source_copy_or_a_plan_names_the_file(tmp_path):
    """Two more of a 4 MiB tmpfs's fill levels: `realloc run: error: No space left on device` (the run secret's
    write; an empty secret file stayed behind) and `realloc run: error: /home/me/exp/ppo_tiny.py: No space left on
    device`, which blamed the experiment file for the copy into config/source/ that failed. And `realloc search
    --out plan.json` or `realloc trace RUN --timeline t.html` on a full disk: `No space left on device`, no file;
    `realloc run --launcher slurm --prepare` left half a job.sbatch there to submit."""
    import textwrap

    from realloc.runtime.records.run_paths import os_error_line

    src = tmp_path / "ppo_tiny.py"
    src.write_text("x" * 1000)
    code = textwrap.dedent(f"""
        import resource, shutil, signal
        from pathlib import Path
        from realloc.atomic_file import write_text_atomically
        from realloc.search.timeline import Panel, write_timeline
        from realloc.runtime.launch.launcher import write_job_script
        from realloc.runtime.records.run_paths import RunPaths
        from realloc.runtime.records.run_paths import os_error_line
        from realloc.runtime.wire import protocol
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10))
        root = Path({str(tmp_path)!r})
        for write in (lambda: protocol.write_secret_file(root / "secret", protocol.new_secret()),
                      lambda: shutil.copy(root / "ppo_tiny.py", root / "copy.py"),
                      lambda: write_text_atomically(root / "plan.json", "x" * 100),
                      lambda: write_timeline([Panel("run", (), ((1, 1.0),), ("cpu0",), ())], root / "t.html"),
                      lambda: write_job_script("x" * 100, RunPaths(root))):
            try:
                write()
            except OSError as e:
                print(os_error_line(e))
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.splitlines() == [f"{tmp_path / 'secret'}: File too large",
                                        f"copying {src} to {tmp_path / 'copy.py'}: File too large",
                                        f"{tmp_path / 'plan.json'}: File too large",
                                        f"{tmp_path / 't.html'}: File too large",
                                        f"{tmp_path / 'job.sbatch'}: File too large"], proc.stderr
    assert not (tmp_path / "secret").exists() and not list(tmp_path.glob(".plan.json.*"))
    assert not (tmp_path / "job.sbatch").exists()  # no half script to submit
    assert os_error_line(OSError(28, "No space left on device", "/a/b")) == "/a/b: No space left on device"


def test_a_full_disk_after_a_checkpoint_is_committed_does_not_say_the_checkpoint_was_not_written(tmp_path,
                                                                                                  monkeypatch):
    """A 12 MiB tmpfs with 5000 KiB free: checkpoint 1 was committed whole (iter_00000001 with its meta.json), then
    trace.json's write after it failed, and the run said `checkpoint 1 could not be written: .../trace.json: No
    space left on device`, so a user would not resume from the checkpoint that is there."""
    import errno

    from realloc.runtime.persist import checkpoint
    from realloc.runtime.records.telemetry import Trace

    real = Trace.add_node

    def full_after_the_save(self, name, kind, *args):
        if kind == "save":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "trace.json"))
        return real(self, name, kind, *args)

    monkeypatch.setattr(Trace, "add_node", full_after_the_save)
    msg = _fake_run(tmp_path, save_every=1)
    assert msg.startswith("the run's records could not be written after ") and "(iteration 1)" in msg, msg
    assert msg.endswith(f"{tmp_path / 'trace.json'}: No space left on device"), msg
    assert checkpoint.find_newest(tmp_path).name == "iter_00000001"  # whole, and what --resume takes


def _fake_run(tmp_path: Path, **kwargs) -> str | None:
    """A master running ppo_tiny with fake workers (2 iterations; ``kwargs`` to it): its one error line, or None
    when the run went well."""
    import asyncio

    from fake_workers import FakeWorkers
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.runtime.control.master import Master
    from realloc.runtime.control.master_link import RunFailed
    from realloc.runtime.control.program import RuntimeProgram
    from realloc.runtime.inputs.run_config import RunConfig
    from realloc.runtime.records.run_paths import RunPaths
    from realloc.runtime.wire import protocol

    spec = load_experiment(TINY)
    graph = build_graph(spec)
    secret = protocol.new_secret()
    master = Master(RuntimeProgram(graph, disjoint_plan()), RunConfig.of(spec), RunPaths(tmp_path), "r1", secret,
                    **{"iterations": 2, "save_final": False, "heartbeat_timeout": 600.0, **kwargs})
    outputs = {c: list(graph.call(c).output_data) for c in graph.topo_order}
    with FakeWorkers(f"tcp://127.0.0.1:{master.port}", secret, "r1", spec.cluster.n_devices, outputs):
        try:
            asyncio.run(master.run())
        except RunFailed as e:
            return str(e)
    return None


def test_a_full_disk_during_an_export_every_n_says_it_was_the_export(tmp_path, monkeypatch):
    """`--export-every 1` on a disk with room for the checkpoint but not its export: the run's line was
    `realloc run: error: RUN/exports/iter_00000001/.actor.part-01158b43/model.safetensors: No space left on device`,
    naming a temporary folder, neither the export nor the checkpoint that holds the state."""
    import errno

    from realloc.runtime.persist import export

    def full(ckpt, model, out, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out.parent / f".{out.name}.part-0/x"))

    monkeypatch.setattr(export, "export_checkpoint", full)
    msg = _fake_run(tmp_path, save_every=1, export_every=1)
    ckpt = tmp_path / "checkpoints" / "iter_00000001"
    assert msg.startswith("the export of actor after iteration 1 (--export-every) could not be written: "), msg
    assert f"No space left on device; checkpoint {ckpt} holds that state" in msg, msg


def test_a_run_branched_from_a_peers_checkpoint_holds_it_while_its_workers_load_it(tmp_path, monkeypatch):
    """`realloc run --resume runs/a/checkpoints/iter_00000001 --run-dir runs/b` while runs/a goes on: runs/a's next
    save pruned iter_00000001 (--keep-checkpoints) while runs/b's workers were reading it. The branching run now
    holds it for reading until its workers have loaded it, so runs/a's prune leaves it for its next save."""
    from realloc.runtime.persist import checkpoint as C
    from realloc.runtime.persist.ckpt_lock import being_read
    from realloc.runtime.wire import protocol

    peer = tmp_path / "a" / "checkpoints"
    for t in (1, 2):
        C.commit(C.begin(peer, t), peer, t, {"next_iteration": t}, "{}")
    branched = peer / "iter_00000001"
    seen, real = [], protocol.Setup

    def setup(**kwargs):  # what the peer's prune would find while this run's workers are told to load it
        seen.append((kwargs["resume"], being_read(branched / C.META), C.prune(peer, peer / "iter_00000002", 1)))
        return real(**kwargs)

    monkeypatch.setattr(protocol, "Setup", setup)
    (tmp_path / "b").mkdir()
    assert _fake_run(tmp_path / "b", resume=branched, start_iteration=1, iterations=1) is None
    assert seen == [(str(branched), True, [])] and branched.is_dir()
    assert C.prune(peer, peer / "iter_00000002", 1) == [branched]  # the peer's next save


def test_an_export_killed_midway_leaves_no_hidden_copy_once_exported_again(tmp_path):
    """`realloc export` killed while writing (SIGKILL, the OOM killer) left `.hf.part-1a2b3c4d/` beside --out, as
    large as the model and hidden; exporting again succeeded and left it there for good. The next export to the
    same --out now removes those of this host whose process is gone, and no other."""
    import socket

    from realloc.runtime.persist.export import export_checkpoint

    ckpt, _ = _fake_checkpoint(tmp_path / "run", CFG, 1, 1, iteration=1)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    host = socket.gethostname()
    parts = {name: tmp_path / f".hf.part-{name}-0a1b2c3d" for name in
             (f"{host}-{gone.pid}", f"{host}-{os.getpid()}", f"other-host-{gone.pid}")}
    for p in parts.values():
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"half")
    export_checkpoint(ckpt, "actor", tmp_path / "hf")
    left = sorted(p.name for p in tmp_path.glob(".hf.part-*"))
    assert left == sorted(parts[k].name for k in (f"{host}-{os.getpid()}", f"other-host-{gone.pid}")), left


def test_checkpoints_kept_for_their_exports_are_pruned_once_the_exports_are_done(tmp_path, monkeypatch):
    """`realloc run --iterations 5 --save-every 1 --keep-checkpoints 1 --export-every 1` (ppo_tiny) ended with all
    five checkpoints: each save left the ones whose export was still running (the first export imports torch in
    the master, seconds) for the next save, and after the last save there is none. The run prunes them once its
    exports are done."""
    import time

    from realloc.runtime.persist import export

    root = tmp_path / "checkpoints"

    def slow_export(ckpt, model, out, **kwargs):  # still running at the next save: until the last checkpoint is in
        deadline = time.monotonic() + 60
        while not (root / "iter_00000002").is_dir() and time.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setattr(export, "export_checkpoint", slow_export)
    assert _fake_run(tmp_path, save_every=1, export_every=1, keep_checkpoints=1) is None
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_00000002"]
