"""Small defects the session's audits left: each test fails without its fix."""

from __future__ import annotations

import errno
import json
import os

import pytest

from realloc.envs.chat_format import HERMES, tool_input
from realloc.tools.keywords import keyword_arguments
from realloc.tools.sandbox import Sandbox, ToolLimits


def test_json_string_arguments_decode_for_one_string_tools_as_for_keyword_tools():
    # OpenAI style: "arguments" is the JSON text of the object
    raw = json.dumps({"expression": "2*3"})
    assert keyword_arguments("calc", ("expression",), raw) == {"expression": "2*3"}
    assert tool_input(raw) == tool_input({"expression": "2*3"}) == "2*3"
    two = {"a": 1, "b": "x"}
    assert tool_input(json.dumps(two)) == json.dumps(two)
    call = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
    assert HERMES.parse(call, ["calculator"]) == ("calculator", "2*3", None)
    # a string that is not a JSON object stays as written
    for text in ("2*3", "[1, 2]", "7", '"q"', "{not json"):
        assert tool_input(text) == text


def test_a_dict_or_list_result_answers_as_json_else_str():
    box = Sandbox(ToolLimits(wall_s=20.0))
    r = box.run("leftovers2_cases:a_dict", "Zürich")
    assert r.status == "ok", r
    assert r.text == '{"city": "Zürich", "n": [1, 2.5, null, true]}'
    r = box.run("json:loads", "[1, {\"k\": \"é\"}]")
    assert r.text == '[1, {"k": "é"}]'
    r = box.run("leftovers2_cases:a_set_inside", "")
    assert r.status == "ok" and r.text == "{'s': {7}}", r


def test_qwen3_head_dim_null_is_refused_as_transformers_refuses_it():
    from transformers import Qwen3Config

    from realloc.models.hf_config import model_config_from_hf

    hf = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 32}
    with pytest.raises(Exception, match="head_dim"):  # the reference: transformers refuses it
        Qwen3Config(**hf, head_dim=None)
    with pytest.raises(ValueError, match=r"^HF config q3: head_dim=None is not supported .*integer head_dim"):
        model_config_from_hf({**hf, "head_dim": None}, "q3")
    assert model_config_from_hf(hf, "q3").head_dim == Qwen3Config(**hf).head_dim == 128
    assert model_config_from_hf({**hf, "head_dim": 32}, "q3").head_dim == 32


def _write_shard(path: str) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_a_workers_disk_error_reads_as_the_masters_records_do(tmp_path):
    from realloc.runtime.control.worker_errors import reply_error
    from realloc.runtime.records.run_paths import os_error_line

    shard = str(tmp_path / "iter_00000001/models/actor/tp0_pp0.safetensors")
    try:
        _write_shard(shard)
    except OSError as e:
        line = reply_error(e)
        assert line.startswith(f"{shard}: No space left on device (in {__file__}, line "), line
        assert line.startswith(os_error_line(e)) and "Errno" not in line and "\n" not in line
    assert reply_error(PermissionError(errno.EACCES, "Permission denied", "/ro/run")) == "/ro/run: Permission denied"
    # not the machine's error: its type stays
    assert reply_error(OSError("socket closed")) == "OSError: socket closed"
    assert reply_error(ValueError("bad")) == "ValueError: bad"


class _Killed(BaseException):
    """A kill of the master between two steps of a commit."""


def test_a_kill_while_a_resave_replaces_iter_n_loses_neither(tmp_path, monkeypatch):
    from pathlib import Path

    from realloc.runtime.persist import checkpoint

    root = tmp_path / "checkpoints"

    def save(it: int, body: bytes) -> Path:
        tmp = checkpoint.begin(root, it)
        (tmp / "models/actor").mkdir(parents=True)
        checkpoint.write_file_durably(tmp / "models/actor/tp0_pp0.safetensors", body)
        return checkpoint.commit(tmp, root, it, {"next_iteration": it}, "{}")

    def shard(ckpt: Path) -> bytes:
        checkpoint.check_files(ckpt)
        return (ckpt / "models/actor/tp0_pp0.safetensors").read_bytes()

    save(1, b"one")
    first = save(2, b"old two")
    real_rename = Path.rename

    def killed_moving_the_new_one_in(self, target):
        if self.name.startswith(".tmp-"):
            raise _Killed
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_moving_the_new_one_in)
    with pytest.raises(_Killed):
        save(2, b"new two")
    monkeypatch.setattr(Path, "rename", real_rename)
    # the resumed run finds iteration 2 as it was committed, by the run directory or by its path
    assert checkpoint.find_newest(first) == first and shard(first) == b"old two"
    assert checkpoint.latest(root) == first
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".tmp-")) == ["iter_00000001",
                                                                                         "iter_00000002"]
    # killed after the new one took the name, before the old one was removed: the new one stays
    real_rmtree = checkpoint.shutil.rmtree

    def killed_removing(path, *a, **k):
        if Path(path).name.startswith(checkpoint.REPLACED):
            raise _Killed
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_removing)
    with pytest.raises(_Killed):
        save(2, b"new two")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert checkpoint.latest(root) == first and shard(first) == b"new two"
    assert sorted(p.name for p in root.iterdir()) == ["iter_00000001", "iter_00000002"]
    assert shard(save(2, b"third two")) == b"third two" and not list(root.glob(".*"))
