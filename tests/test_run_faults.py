"""A real ``realloc run`` whose run directory turns read-only while it trains (issue 22 item 22).

The run must end with one line naming the real cause (the checkpoint or record it could not write, and why),
not a cleanup error about ``requests.jsonl`` or the secret; no worker may outlive it, and no secret may stay in
the directory. Root ignores file modes, so under root the run starts without the capabilities that let it
(``setpriv`` drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its bounding set, which its workers inherit).
(A full disk is simulated in-process in tests/test_master_state.py: a tmpfs needs root to mount.)
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = os.getuid() == 0
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def _processes_naming(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.skipif(ROOT and shutil.which("setpriv") is None, reason="root ignores file modes; setpriv drops that")
def test_a_run_directory_made_read_only_mid_run_ends_in_one_line_with_nothing_left(tmp_path):
    run_dir = tmp_path / "run"
    try:
        run_dir.mkdir()
        cmd = [*(NO_OVERRIDE if ROOT else []), sys.executable, "-m", "realloc.cli", "run",
               str(REPO / "experiments/ppo_tiny.py"), "--baseline", "heuristic", "--iterations", "4", "--save-every",
               "4", "--run-dir", str(run_dir), "--quiet", "--no-tensorboard"]
        env = {**os.environ, "HOME": str(run_dir), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip()):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no iteration finished"
                time.sleep(0.05)
            os.chmod(run_dir, 0o555)  # read-only from iteration 2 on: the checkpoint after iteration 4 cannot be made
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode not in (0, None), out + err
        lines = [x for x in err.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("realloc run: error:") or "internal error" in x]
        assert len(errors) == 1 and "Traceback" not in err, err
        assert "Permission denied" in errors[0] and str(run_dir) in errors[0], errors[0]
        assert "could not be written" in errors[0] and "secret" not in errors[0], errors[0]
        assert not _processes_naming(str(run_dir)), "a worker outlived the run"
        secret = run_dir / "secret"
        assert not secret.exists() or secret.stat().st_size == 0
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o555  # it really was read-only to the end
    finally:
        if run_dir.exists():
            os.chmod(run_dir, 0o755)  # so that pytest can remove it
