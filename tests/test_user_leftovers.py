"""Three defects a new user hits: a hand-written plan's integer field given as true/false (read as 1/0 by pydantic)
is refused naming the call and field; a dataset edited between a run and its resume is refused naming the file;
a large ``log_samples`` cannot push a worker's reply over the wire message limit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from realloc.api import load_experiment
from realloc.cli import EXIT_USAGE, main
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import CallPlacement, ExecutionPlan

PPO = "experiments/ppo_7b_7b.py"


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "n_mbs"])
def test_a_placement_count_given_as_a_bool_is_one_line_naming_the_call_and_field(tmp_path, capsys, field):
    graph = build_graph(load_experiment(PPO))
    places = {c: ("trainer[01-02]", 8, 2, 1, 4) for c in graph.spec.call_names}
    good = tmp_path / "good.json"
    ExecutionPlan.by_hand(graph, places).save(good)
    assert main(["show", PPO, "--plan", str(good)]) == 0  # the same plan with numbers is fine
    capsys.readouterr()
    body = json.loads(good.read_text())
    body["placements"]["actor_gen"][field] = True
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(body))
    assert main(["show", PPO, "--plan", str(bad)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"field 'placements.actor_gen.{field}'" in err and "not true/false" in err
    with pytest.raises(ValueError, match=f"field 'placements.actor_gen.{field}'.*not true/false"):
        ExecutionPlan.load(bad)
    with pytest.raises(ValueError, match=f"field 'placements.actor_gen.{field}'.*not true/false"):
        ExecutionPlan.by_hand(graph, {**places, "actor_gen": {**dict(zip(("mesh", "dp", "tp", "pp", "n_mbs"),
                                                                          places["actor_gen"])), field: True}})
    assert CallPlacement(mesh="trainer01", dp=1, tp=1, pp=1).dp == 1


@pytest.mark.parametrize("field", ["staleness", "n_devices_per_node", "format_version"])
def test_a_plan_level_count_given_as_a_bool_is_refused_by_name(tmp_path, field):
    graph = build_graph(load_experiment(PPO))
    body = json.loads(ExecutionPlan.by_hand(graph, {c: ("trainer[01-02]", 8, 2, 1, 4)
                                                    for c in graph.spec.call_names}).to_json())
    body[field] = True
    with pytest.raises(ValueError, match=f"field '{field}'.*not true/false"):
        ExecutionPlan.from_json(json.dumps(body))


# -- a dataset edited between a run and its resume ----------------------------------------------------------------
TINY = str(Path(__file__).resolve().parents[1] / "experiments/ppo_tiny.py")


def test_a_resume_whose_dataset_changed_is_refused_naming_the_file(tmp_path, capsys):
    from realloc.overrides import load_with_overrides
    from realloc.runtime.persist import checkpoint as C
    from realloc.runtime.persist.run_settings import checkpoint_settings, resume_settings
    from realloc.runtime.records.run_record import Session, write_run_record

    data = tmp_path / "prompts.jsonl"
    shutil.copy(Path(TINY).parent / "data/ppo_tiny_prompts.jsonl", data)
    sets = [f"dataset={data}"]
    run = tmp_path / "run"
    spec = load_with_overrides(TINY, sets)
    write_run_record(run, spec, Session(experiment=TINY, overrides=tuple(sets), given=tuple(sets)))
    recorded = json.loads((run / "run.json").read_text())["sessions"][-1]["data"]
    assert recorded[str(data)] == {"bytes": data.stat().st_size,
                                   "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}
    assert set(recorded) == {str(data), str(Path(TINY).parent / "data/ppo_tiny_eval.jsonl")}  # the eval set too
    tmp = C.begin(run / "checkpoints", 2)
    ckpt = C.commit(tmp, run / "checkpoints", 2, {"next_iteration": 2, "settings": checkpoint_settings(spec, run)}, "{}")
    assert resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=False).changed == ()
    lines = data.read_text().splitlines()
    data.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")  # same rows, same size, another order
    assert data.stat().st_size == recorded[str(data)]["bytes"]
    with pytest.raises(ValueError, match=f"dataset {data}: its content changed since the checkpoint's run"):
        resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=False)
    assert main(["run", TINY, "--resume", str(ckpt), "--iterations", "3"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(data) in err and "--allow-changed-settings" in err
    got = resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=True)
    assert any(str(data) in c for c in got.changed), got.changed
    data.unlink()
    with pytest.raises(ValueError, match=f"dataset {data}: no longer exists"):
        resume_settings(TINY, ckpt, C.read_meta(ckpt), [], allow_changed=False)


# -- a large log_samples with long responses and the wire's message limit -----------------------------------------
def test_a_reply_with_many_long_samples_stays_under_the_message_limit(tiny_tok, monkeypatch, caplog):
    """64 logged rows of 16384 response tokens: the generation's log-probs (9 bytes a float on the wire) are
    64 x 16384 x 9 = 9.4 MB, over the 8 MiB limit of one message (the reward call's text and ids are 4.5 bytes a
    token with the tiny model's 500-token vocabulary, about 9 with a real one); the sample log caps what one reply
    carries (text_io.SAMPLE_BYTES) and says so in one line naming log_samples."""
    import torch

    from realloc.runtime.records import text_io
    from realloc.runtime.wire.protocol import MAX_PAYLOAD_BYTES, Channel, MessageTooLarge, Reply

    rows, plen, n = 64, 64, 16384
    g = torch.Generator().manual_seed(0)
    seq = {"tokens": torch.randint(3, 400, (rows, plen + n), generator=g),
           "prompt_lens": torch.full((rows,), plen), "gen_mask": torch.ones(rows, n, dtype=torch.bool)}
    logp = -torch.rand(rows, n, generator=g, dtype=torch.float64) * 5
    scores = torch.rand(rows, generator=g)
    channel = Channel(b"s" * 32, "run", "worker0")
    log = text_io.SampleLog(tiny_tok, every=1, count=10_000)

    def reply(**given) -> list:
        return channel.pack("master", Reply(req=1, rank=0, ok=True, samples=log.parts(0, range(rows), "seq", seq,
                                                                                       **given)))

    with monkeypatch.context() as m:  # without the cap: the reply could not be sent
        m.setattr(text_io, "SAMPLE_BYTES", 1 << 40)
        with pytest.raises(MessageTooLarge, match="'samples' field"):
            reply(logp=logp)
    for given in ({"logp": logp}, {"scores": scores}):
        caplog.clear()
        with caplog.at_level("WARNING", logger="realloc.samples"):
            frames = reply(**given)
        assert len(frames[0]) <= text_io.SAMPLE_BYTES < MAX_PAYLOAD_BYTES
        kept = len(Channel(b"s" * 32, "run", "master").unpack(frames, peer=b"w").body.samples)
        assert 0 < kept < rows
        [line] = [r.getMessage() for r in caplog.records]
        assert f"logging {kept} of the {rows} samples of iteration 1" in line and "log_samples" in line
