"""Runs you can reproduce and pick up again (issue 22, items 8-13), without starting workers: which checkpoints a
run saves and keeps, the settings ``--resume`` reapplies and refuses to change, what the run directory records
about how it was made, and how a resumed run appends to its requests.jsonl and trace.json."""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
import types
from pathlib import Path

import pytest

from realloc.runtime.persist import checkpoint as C
from realloc.runtime.persist.run_settings import checkpoint_settings, merge_overrides, resume_settings
from realloc.runtime.records.run_record import (Session, data_record, differences, jsonable, resolved_experiment,
                                                write_run_record)
from realloc.runtime.records.telemetry import TRACE_HEAD, RequestLog, RequestRecord, Trace, join_sessions

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "experiments/ppo_tiny.py")


# -- item 8: the final checkpoint and how many are kept ---------------------------------------------------------
def _saves(**attrs):
    from realloc.runtime.control.master_checkpoints import CheckpointSaves

    obj = types.SimpleNamespace(**{"save_every": 0, "export_every": 0, "save_final": False, **attrs})
    obj._every = types.MethodType(CheckpointSaves._every, obj)
    return [t for t in range(obj.end) if CheckpointSaves._saves_after(obj, t)]


def test_the_final_state_is_saved_whatever_save_every_says():
    # end = 5 iterations (t = 0..4): t is the 0-based iteration the checkpoint follows.
    assert _saves(end=5) == []
    assert _saves(end=5, save_final=True) == [4]
    assert _saves(end=5, save_every=2) == [1, 3, 4]  # every 2, and the last one
    assert _saves(end=5, save_every=2, save_final=True) == [1, 3, 4]
    assert _saves(end=7, start=3, save_final=True) == [6]


def _committed(root: Path, *iterations: int) -> list[Path]:
    out = []
    for i in iterations:
        d = root / C.checkpoint_name(i)
        d.mkdir(parents=True)
        (d / C.META).write_text("{}")
        out.append(d)
    return out


def test_prune_keeps_the_newest_n_up_to_the_one_just_saved(tmp_path):
    root = tmp_path / "checkpoints"
    c1, c2, c3, c4, c7 = _committed(root, 1, 2, 3, 4, 7)  # 7: left by a run this one resumed before it
    (root / ".tmp-iter_00000005-ab").mkdir()  # an uncommitted one is not a checkpoint to count
    assert C.prune(root, c4, keep=0) == []  # 0 keeps all
    assert C.prune(root, c4, keep=2, busy=[c2]) == [c1]  # c2 is being exported: the next save prunes it
    assert sorted(p.name for p in root.iterdir()) == [".tmp-iter_00000005-ab", c2.name, c3.name, c4.name, c7.name]
    assert C.prune(root, c4, keep=2) == [c2]
    assert C.prune(root, c4, keep=1) == [c3]
    assert sorted(p.name for p in root.glob("iter_*")) == [c4.name, c7.name]


def test_export_of_a_run_without_checkpoints_says_so_without_resume(tmp_path, capsys):
    from realloc.cli import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["export", str(tmp_path / "run"), "--model", "actor", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint to export from" in err[0] and "--no-final-checkpoint" in err[0], err
    assert "--resume" not in err[0]
    assert main(["export", str(tmp_path / "nowhere"), "--model", "actor", "--out", str(tmp_path / "o")]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err
    root = tmp_path / "run" / "checkpoints"
    _committed(root, 2)
    (root / C.checkpoint_name(4)).mkdir()  # damaged: no meta.json; the advice is export's own flag
    assert main(["export", str(tmp_path / "run"), "--model", "actor", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--iteration 2" in err and "--resume" not in err


# -- item 9: --resume reapplies the checkpoint's settings and refuses a changed one ----------------------------
def test_merge_overrides_replaces_a_key_given_again():
    assert merge_overrides(["a=1", "b.c=2"], ["b.c=3", "d=x=y"]) == ("a=1", "b.c=3", "d=x=y")
    assert merge_overrides([], []) == ()


def test_differences_name_the_set_key_and_both_values():
    before = {"config": {"ppo": {"lr": 1e-3, "clip_eps": 0.2}, "eval": {"every": 0}}, "workload": {"batch_size": 32},
              "cluster": {"nodelist": "localhost"}}
    after = {"config": {"ppo": {"lr": 2e-3, "clip_eps": 0.2}, "eval": {"every": 0}}, "workload": {"batch_size": 64},
             "cluster": {"nodelist": "localhost"}}
    assert differences(before, after) == ["ppo.lr: 0.001 -> 0.002", "batch_size: 32 -> 64"]
    assert differences(before, before) == []
    # A field only one realloc version records is no change; an empty group that got entries is.
    newer = {**after, "config": {**after["config"], "ppo": {**after["config"]["ppo"], "entropy_coef": 0.0}}}
    assert differences(after, newer) == []
    # Derived sections (the run settings as resolved, e.g. an absolute dataset path) are not compared.
    assert differences({**before, "run": {"dataset": "/a/p.jsonl"}}, {**before, "run": {"dataset": "/b/p.jsonl"}}) == []
    assert differences({"config": {"models": {}}}, {"config": {"models": {"rm": "/x"}}}) == ['models.rm: <unset> -> "/x"']
    assert differences({"config": {"m": 1}}, {"config": {"m": {"a": 2}}}) == ['m.a: <unset> -> 2']


def _checkpoint_with_settings(tmp_path: Path, experiment: str, overrides: list[str], done: int = 2) -> Path:
    """A committed checkpoint whose meta.json records the settings a run of ``experiment`` with ``overrides``
    saves (what the master writes), in a run directory whose run.json holds those overrides."""
    from realloc.overrides import load_with_overrides

    run = tmp_path / "run"
    spec = load_with_overrides(experiment, overrides)
    write_run_record(run, spec, Session(experiment=experiment, overrides=tuple(overrides), given=tuple(overrides)))
    tmp = C.begin(run / "checkpoints", done)
    return C.commit(tmp, run / "checkpoints", done, {"next_iteration": done,
                                                     "settings": checkpoint_settings(spec, run)}, "{}")


def test_resume_reapplies_the_recorded_overrides(tmp_path):
    ckpt = _checkpoint_with_settings(tmp_path, TINY, ["ppo.lr=1e-3", "eval.every=2"])
    got = resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=False)
    assert got.overrides == ("ppo.lr=1e-3", "eval.every=2") and got.changed == ()
    assert got.spec.config.ppo.lr == 1e-3 and got.spec.config.eval.every == 2
    # Given again with the same value: no change.
    same = resume_settings(TINY, ckpt, C.read_meta(ckpt), ["ppo.lr=0.001"], allow_changed=False)
    assert same.changed == () and same.spec.config.ppo.lr == 1e-3


def test_resume_refuses_a_changed_setting_naming_it_unless_allowed(tmp_path, capsys):
    from realloc.cli import main

    ckpt = _checkpoint_with_settings(tmp_path, TINY, ["ppo.lr=1e-3"])
    code = main(["run", TINY, "--resume", str(ckpt), "--iterations", "9", "--set", "ppo.lr=2e-3",
                 "--set", "ppo.kl_coef=0.05"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "ppo.kl_coef: 0.01 -> 0.05" in err[0] and "ppo.lr: 0.001 -> 0.002" in err[0]
    assert "--allow-changed-settings" in err[0] and "reapplied: ppo.lr=1e-3" in err[0]
    got = resume_settings(TINY, ckpt, C.read_meta(ckpt), ["ppo.lr=2e-3"], allow_changed=True)
    assert got.changed == ("ppo.lr: 0.001 -> 0.002",) and got.spec.config.ppo.lr == 2e-3
    assert main(["run", TINY, "--allow-changed-settings", "--iterations", "1"]) == 2
    assert "applies to --resume" in capsys.readouterr().err


def test_resume_refuses_a_changed_max_staleness_like_the_other_workload_settings(tmp_path):
    """Issue 30, defect 4: --set max_staleness=2 on a run made with 1 is a change, named, and recorded as one."""
    ckpt = _checkpoint_with_settings(tmp_path, TINY, ["max_staleness=1"])
    assert resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=False).spec.max_staleness == 1
    with pytest.raises(ValueError, match="max_staleness: 1 -> 2"):
        resume_settings(TINY, ckpt, C.read_meta(ckpt), ["max_staleness=2"], allow_changed=False)
    got = resume_settings(TINY, ckpt, C.read_meta(ckpt), ["max_staleness=2"], allow_changed=True)
    assert got.spec.max_staleness == 2 and any("max_staleness: 1 -> 2" in c for c in got.changed), got.changed


def test_resume_refuses_an_edited_experiment_or_module(tmp_path):
    exp_dir = tmp_path / "exp"
    exp_dir.mkdir()
    text = Path(TINY).read_text().replace("import dataclasses\n", "import dataclasses\n\nimport h22_helper\n", 1)
    text = text.replace("kl_coef=0.01", "kl_coef=h22_helper.KL")
    (exp_dir / "my_exp.py").write_text(text)
    (exp_dir / "h22_helper.py").write_text("KL = 0.01\n")
    experiment = str(exp_dir / "my_exp.py")
    ckpt = _checkpoint_with_settings(tmp_path, experiment, [])
    assert sorted(p.name for p in (tmp_path / "run/config/source").iterdir()) == ["h22_helper.py", "my_exp.py"]
    assert resume_settings(experiment, ckpt, C.read_meta(ckpt), [], allow_changed=False).changed == ()
    (exp_dir / "h22_helper.py").write_text("KL = 0.01  # same value, edited file\n")
    with pytest.raises(ValueError, match="file h22_helper.py: its content changed"):
        resume_settings(experiment, ckpt, C.read_meta(ckpt), [], allow_changed=False)
    (exp_dir / "my_exp.py").write_text(text.replace("seed: int = 1", "seed: int = 2"))
    with pytest.raises(ValueError, match=r"seed: 1 -> 2; file h22_helper.py: its content changed; file my_exp.py: its content changed"):
        resume_settings(experiment, ckpt, C.read_meta(ckpt), [], allow_changed=False)


def test_an_older_checkpoint_falls_back_to_run_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"experiment": TINY, "overrides": ["ppo.lr=1e-3"]}))  # the old format
    tmp = C.begin(run / "checkpoints", 3)
    ckpt = C.commit(tmp, run / "checkpoints", 3, {"next_iteration": 3}, "{}")
    got = resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=False)
    assert got.overrides == ("ppo.lr=1e-3",) and got.spec.config.ppo.lr == 1e-3
    with pytest.raises(ValueError, match="ppo.lr: 0.001 -> 0.0005"):
        resume_settings(TINY, ckpt, C.read_meta(ckpt), ["ppo.lr=5e-4"], allow_changed=False)


# -- item 10: what the run directory records ----------------------------------------------------------------------
def test_the_run_directory_records_every_setting_versions_and_sessions(tmp_path):
    import torch

    from realloc.overrides import load_with_overrides

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"experiment": TINY, "overrides": ["ppo.lr=1e-3"]}))  # before sessions
    spec = load_with_overrides(TINY, ["ppo.lr=1e-3", "batch_size=16"])
    write_run_record(run, spec, Session(TINY, ("ppo.lr=1e-3", "batch_size=16"), ("batch_size=16",), "ckpt", 4, 9,
                                        ("batch_size: 32 -> 16",)), argv=["realloc", "run"])
    body = json.loads((run / "run.json").read_text())
    assert body["overrides"] == ["ppo.lr=1e-3", "batch_size=16"]
    first, second = body["sessions"]
    assert first == {"session": 1, "experiment": TINY, "overrides": ["ppo.lr=1e-3"]}
    assert second["session"] == 2 and second["resumed_from"] == "ckpt" and second["iterations"] == [4, 9]
    assert second["changed"] == ["batch_size: 32 -> 16"] and second["argv"] == ["realloc", "run"]
    assert second["packages"]["torch"] == torch.__version__
    assert second["git"]["realloc"] is None or len(second["git"]["realloc"]["commit"]) == 40
    resolved = json.loads((run / "config/experiment.json").read_text())
    # Overrides applied, every default filled in (PPOConfig's clip_eps, the eval settings), workload and calls.
    assert resolved["config"]["ppo"]["lr"] == 1e-3 and resolved["config"]["ppo"]["clip_eps"] == 0.2
    assert resolved["config"]["ppo"]["critic_lr"] == 2e-3 and resolved["config"]["eval"]["every"] == 0
    assert resolved["workload"] == {"batch_size": 16, "prompt_len": 8, "gen_len": 8, "max_staleness": 0}
    assert resolved["calls"]["actor_train"]["n_minibatches"] == 2
    assert resolved["calls"]["rew_inf"]["interface_args"]["tokens"] == list(range(16, 32))
    assert resolved == json.loads(json.dumps(resolved_experiment(spec)))
    assert (run / "config/source/ppo_tiny.py").read_bytes() == Path(TINY).read_bytes()
    env = json.loads((run / "config/environment.json").read_text())
    assert env["packages"]["torch"] == torch.__version__ and env["python"].count(".") == 2


def test_jsonable_names_functions_and_never_addresses():
    def rule(prompt, response, answer):
        return 0.0

    class Scorer:
        def __init__(self):
            self.weight = 0.5
            self._cache = {}

    got = jsonable({"f": rule, "o": Scorer(), "t": (1, float("inf")), "p": Path("/x")})
    assert got["f"].endswith("test_jsonable_names_functions_and_never_addresses.<locals>.rule")
    assert got["o"]["weight"] == 0.5 and "_cache" not in got["o"]
    assert got["t"] == [1, "inf"] and got["p"] == "/x"
    assert "0x" not in json.dumps(jsonable(object()))


def test_data_json_reports_the_runs_gen_len_for_a_prompt_dataset():
    from realloc.data.records import LoadStats
    from realloc.overrides import load_with_overrides

    spec = load_with_overrides(TINY, ["gen_len=32"])
    stats = LoadStats(source="p.jsonl", prompt_len=8, n_records=4, n_kept=4, n_truncated=0, n_dropped=0, n_empty=0,
                      max_tokens=8, mean_tokens=8.0)
    body = data_record(stats, spec)
    assert body["gen_len"] == 32 and body["has_responses"] is False and body["n_kept"] == 4


def test_tensorboard_gets_the_config_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from realloc.runtime.records.metric_sinks import MetricSinks

    config = {"experiment": "x.py", "overrides": ["ppo.lr=1e-3"], "resolved": {"config": {"ppo": {"lr": 1e-3}}}}
    sinks = MetricSinks.open(tmp_path, tensorboard=True, wandb_project=None, run_name="t", config=config)
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (text,) = events.Tensors("config/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert json.loads(textwrap.dedent(shown)) == config


# -- item 11: a resumed run appends to requests.jsonl and trace.json ----------------------------------------------
def _record(req: int, t: int, start: float, kind: str = "call") -> RequestRecord:
    return RequestRecord(req=req, kind=kind, label="actor_gen", iteration=t, node="actor_gen", dispatched=start,
                         ranks=(0,), completed=start + 1.0, spans={0: (start, start + 1.0)}, received={0: start + 1.0})


def test_a_resumed_run_appends_to_the_request_log_and_trace(tmp_path):
    trace_path, log_path = tmp_path / "trace.json", tmp_path / "requests.jsonl"
    # Session 1: set-up, then iterations 1..3 (0-based t 0..2); killed: the trace is never closed and the
    # request log's last line is half written.
    trace, log = Trace(trace_path, 1, ["n:0"], t0=100.0), RequestLog(log_path)
    for rec in (_record(0, -1, 100.0, "setup"), _record(1, 0, 101.0), _record(2, 1, 102.0), _record(3, 2, 103.0)):
        trace.add(rec)
        log.write(rec)
    trace.flush()
    log.flush()
    with open(log_path, "a") as f:
        f.write('{"req": 4, "ki')
    # Session 2 resumes from the checkpoint after iteration 2, an hour later: iteration 3 is done again.
    trace, log = Trace(trace_path, 1, ["n:0"], t0=3700.0, resume_after=2), RequestLog(log_path, resume_after=2)
    for rec in (_record(0, -1, 3700.0, "setup"), _record(1, 2, 3702.0)):
        trace.add(rec)
        log.write(rec)
    trace.close()
    log.close()
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert [(r["session"], r["kind"], r["iteration"]) for r in lines] == [
        (1, "setup", 0), (1, "call", 1), (1, "call", 2), (2, "setup", 0), (2, "call", 3)]
    events = json.loads(trace_path.read_text())["traceEvents"]
    boxes = [(e["args"]["iteration"], e["ts"]) for e in events if e["ph"] == "X"]
    # Session 1's events at their times; session 2's follow the last kept one (ends at 3.0 s) after a 1 s gap.
    assert boxes == [(0, 0.0), (1, 1e6), (2, 2e6), (0, 4e6), (3, 6e6)]
    (marker,) = [e for e in events if e["ph"] == "i"]
    assert marker["name"] == "resumed after iteration 2" and marker["ts"] == 3.5e6
    assert sum(e["ph"] == "M" and e["name"] == "thread_name" for e in events) == 1
    # Drawn end to end: session 2's iteration 3 starts where session 1's iteration 2 ended (103.0 s).
    joined = join_sessions(lines)
    assert joined[4]["spans"]["0"] == [103.0, 104.0] and joined[4]["dispatched"] == 103.0
    assert joined[:3] == lines[:3]
    # A third session numbers on. Resuming from further back (after iteration 1) keeps session 2's set-up and
    # its marker, drops its iteration 3 and session 1's iteration 2.
    assert RequestLog(log_path, resume_after=3).session == 3
    Trace(trace_path, 1, ["n:0"], t0=9000.0, resume_after=1).close()
    events = json.loads(trace_path.read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["resumed after iteration 2", "resumed after iteration 1"]
    assert [e["args"]["iteration"] for e in events if e["ph"] == "X"] == [0, 1, 0]
    # A marker after the last kept event goes (here: every event after iteration 0 of session 1 is dropped).
    kept = [json.loads(x.rstrip(",")) for x in trace_path.read_text().splitlines()[1:-1]]
    trace_path.write_text(TRACE_HEAD + ",\n".join(json.dumps(e) for e in kept if e.get("args", {}).get("iteration")
                                                    != 0 or e["ts"] < 1e6))
    Trace(trace_path, 1, ["n:0"], t0=9000.0, resume_after=0).close()
    events = json.loads(trace_path.read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["resumed after iteration 0"]


def test_trace_cli_draws_iterations_from_before_and_after_a_resume(tmp_path, capsys):
    from realloc.cli import main
    from run_helpers import disjoint_plan

    run = tmp_path / "run"
    run.mkdir()
    disjoint_plan().save(run / "plan.json")
    (run / "run.json").write_text(json.dumps({"experiment": TINY, "overrides": []}))
    rows = []
    for session, (t, start) in [(1, (0, 10.0)), (1, (1, 12.0)), (2, (2, 5000.0))]:
        rows.append({"req": t, "session": session, "kind": "call", "label": "actor_gen", "iteration": t + 1,
                     "dispatched": start, "completed": start + 2.0, "spans": {"0": [start, start + 2.0]},
                     "received": {"0": start + 2.0}})
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.svg"
    assert main(["trace", str(run), "--timeline", str(out), "--iterations", "1..3", "--no-estimate"]) == 0
    # 2 s per iteration across the resume: the hours between the sessions are not drawn.
    assert "measured, iterations 1..3 (2.000 s/it after the first)" in capsys.readouterr().out


def test_resume_copy_of_sources_keeps_the_earlier_files(tmp_path):
    from realloc.overrides import load_with_overrides

    exp_dir = tmp_path / "exp"
    exp_dir.mkdir()
    shutil.copy(TINY, exp_dir / "e.py")
    run = tmp_path / "run"
    spec = load_with_overrides(str(exp_dir / "e.py"))
    write_run_record(run, spec, Session(str(exp_dir / "e.py"), (), ()))
    write_run_record(run, spec, Session(str(exp_dir / "e.py"), (), ()))  # unchanged: one copy
    assert sorted(p.name for p in (run / "config").iterdir()) == ["environment.json", "experiment.json", "source"]
    (exp_dir / "e.py").write_text((exp_dir / "e.py").read_text() + "\n# edited\n")
    write_run_record(run, load_with_overrides(str(exp_dir / "e.py")), Session(str(exp_dir / "e.py"), (), ()))
    assert (run / "config/source.session2/e.py").read_bytes() == Path(TINY).read_bytes()
    assert (run / "config/source/e.py").read_text().endswith("# edited\n")
    assert len(json.loads((run / "run.json").read_text())["sessions"]) == 3


def test_wandb_gets_the_resolved_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # an optional extra for installs; the test environment has it
    from realloc.overrides import load_with_overrides
    from realloc.runtime.records.metric_sinks import MetricSinks

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    resolved = resolved_experiment(load_with_overrides(TINY, ["ppo.clip_eps=0.375"]))
    sinks = MetricSinks.open(tmp_path, tensorboard=False, wandb_project="realloc-test", run_name="t",
                             config={"experiment": TINY, "overrides": ["ppo.clip_eps=0.375"], "resolved": resolved})
    sinks.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    data = next(run.glob("run-*.wandb")).read_bytes()
    assert b"clip_eps" in data and b"0.375" in data and b"gae_lambda" in data  # the override and a default


def test_checkpoints_record_the_files_as_the_run_loaded_them(tmp_path):
    """An experiment file edited while the run trains: the checkpoints still record the loaded one's digest, so
    resuming with the edited file is a change."""
    from realloc.overrides import load_with_overrides

    exp = tmp_path / "e.py"
    shutil.copy(TINY, exp)
    spec = load_with_overrides(str(exp))
    write_run_record(tmp_path / "run", spec, Session(str(exp), (), ()))
    loaded = checkpoint_settings(spec, tmp_path / "run")["sources"]
    exp.write_text(exp.read_text() + "\n# edited during the run\n")
    assert checkpoint_settings(spec, tmp_path / "run")["sources"] == loaded != {"e.py": "0" * 64}
    assert loaded["e.py"] == hashlib.sha256(Path(TINY).read_bytes()).hexdigest()


def test_an_algorithms_settings_are_recorded_with_defaults_when_the_experiment_has_no_field(tmp_path):
    from realloc.algorithms.ppo.ppo_config import PPOConfig
    from realloc.overrides import load_with_overrides
    from realloc.runtime.persist.run_settings import full_resolved

    text = Path(TINY).read_text()
    text = text.replace("    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=2e-3, critic_lr=2e-3, kl_coef=0.01)\n", "")
    text = text.replace("n_minibatches=self.ppo.n_minibatches", "n_minibatches=2")
    assert "self.ppo" not in text
    (tmp_path / "noppo.py").write_text(text)
    resolved = full_resolved(load_with_overrides(str(tmp_path / "noppo.py")))
    assert "ppo" not in resolved["config"] and resolved["settings"]["ppo"] == jsonable(PPOConfig())
    assert resolved["interfaces"]["critic_train"] == "ppo_critic (train_step)"
    assert resolved["run"]["dataset"] == str(tmp_path / "data/ppo_tiny_prompts.jsonl")  # resolved on this machine
    assert resolved["run"]["sample_every"] == 10 and resolved["run"]["eval"]["every"] == 0


def test_a_recorded_override_the_experiment_no_longer_has_is_one_error_saying_so(tmp_path):
    exp = tmp_path / "e.py"
    exp.write_text(Path(TINY).read_text().replace("    seed: int = 1\n", "    seed: int = 1\n    extra: int = 0\n"))
    ckpt = _checkpoint_with_settings(tmp_path, str(exp), ["extra=3"])
    assert resume_settings(str(exp), ckpt, C.read_meta(ckpt), [], allow_changed=False).spec.config.extra == 3
    with pytest.raises(ValueError, match=r"^--set nope: experiment TinyPPO has no field 'nope'"):
        resume_settings(str(exp), ckpt, C.read_meta(ckpt), ["nope=1"], allow_changed=True)  # the command's own
    shutil.copy(TINY, exp)
    with pytest.raises(ValueError, match=r"overrides of the run that wrote the checkpoint \(extra=3\) no longer "
                                         r"apply .*has no field 'extra'"):
        resume_settings(str(exp), ckpt, C.read_meta(ckpt), [], allow_changed=True)
