"""Where profiles are read and written (issue 14, item 4): ``--profiles DIR`` / ``$REALLOC_PROFILES`` come
before the shipped profiles, and ``realloc profile`` never overwrites a shipped table unless told to."""

from __future__ import annotations

import json
import shutil

import pytest

from realloc.cli import main
from realloc.estimator.hardware import load_hardware_spec, shipped_profiles_dir
from realloc.estimator.profile_table import discover_profiles


@pytest.fixture
def no_profiles_env(monkeypatch):
    """No $REALLOC_PROFILES now, and none left behind by ``--profiles`` (which sets it for the process)."""
    monkeypatch.setenv("REALLOC_PROFILES", "")
    monkeypatch.delenv("REALLOC_PROFILES")


def test_profile_without_out_or_profiles_is_one_clear_error_and_writes_nothing(capsys, no_profiles_env):
    shipped = shipped_profiles_dir() / "cpu" / "tiny.json"
    before = shipped.stat().st_mtime_ns
    assert main(["profile", "--model", "tiny", "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--profiles DIR" in err and "--out FILE" in err
    assert shipped.stat().st_mtime_ns == before


def test_own_profiles_come_first_and_hardware_falls_back_to_the_shipped(tmp_path, monkeypatch):
    own = tmp_path / "mine"
    (own / "cpu").mkdir(parents=True)
    table = json.loads((shipped_profiles_dir() / "cpu" / "tiny.json").read_text())
    table["meta"]["command"] = "measured on my machine"
    (own / "cpu" / "tiny.json").write_text(json.dumps(table))
    monkeypatch.setenv("REALLOC_PROFILES", str(own))
    tables = {t.model_type: t for t in discover_profiles("cpu")}
    assert tables["tiny"].meta["command"] == "measured on my machine"
    assert "small" in tables  # not in DIR: the shipped table is still found
    assert load_hardware_spec("a100-80g").name  # DIR has no hardware/: the shipped specs are used
    # A hardware spec of one's own wins over the shipped one of the same kind.
    (own / "hardware").mkdir()
    spec = json.loads((shipped_profiles_dir() / "hardware" / "cpu.json").read_text())
    spec["memory_bytes"] = 12345 * 2**20
    (own / "hardware" / "cpu.json").write_text(json.dumps(spec))
    assert load_hardware_spec("cpu").memory_bytes == 12345 * 2**20


def test_search_profiles_option_reads_the_folder(tmp_path, capsys, no_profiles_env):
    own = tmp_path / "mine"
    shutil.copytree(shipped_profiles_dir() / "hardware", own / "hardware")
    spec = json.loads((own / "hardware" / "cpu.json").read_text())
    spec["memory_bytes"] = 3 * 2**30
    (own / "hardware" / "cpu.json").write_text(json.dumps(spec))
    assert main(["search", "experiments/ppo_tiny.py", "--evals", "500", "--threads", "1",
                 "--profiles", str(own)]) == 0
    assert "cpu device(s), 3.0 GiB each" in capsys.readouterr().out  # the cluster line shows DIR's memory


def test_missing_profiles_folder_is_one_clear_error(capsys, no_profiles_env):
    assert main(["search", "experiments/ppo_tiny.py", "--evals", "10", "--profiles", "/nonexistent/x"]) == 2
    assert "--profiles '/nonexistent/x': no such folder" in capsys.readouterr().err
