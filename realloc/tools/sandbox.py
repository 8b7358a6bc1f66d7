"""Run one tool call in a contained child process: the parent side (``child.py`` is the child).

A tool is a Python function ``tool(text: str) -> str | None`` named ``"module:function"`` (as rewards are): it
gets the text of the policy's call and returns the observation; what it prints is part of the observation too.
Each call spawns a fresh ``python -I`` (never a fork of the training process: no copy of its memory, its CUDA
context or the run's secret, whose environment variables the child does not get) in a new session. The tool runs
in a child of that process, which is a child subreaper: every process the tool starts, a daemon in a session of
its own included, dies when the call ends (``child._keep``).

Limits (``ToolLimits``): wall time (the parent ends the call: ``_end``), CPU time (``RLIMIT_CPU``), address space
(``RLIMIT_AS``), bytes of output (the parent reads at most that many, then ends the call), processes
(``RLIMIT_NPROC``; when the parent is root the child first becomes ``nobody``, since root ignores that limit, which
also keeps it from writing to the user's files), file size (``RLIMIT_FSIZE``), the files' total (the parent
watches the working folder: ``disk_mb``), files and signals (Landlock, where
the kernel has it: ``landlock_abi``; ``read_paths``) and no network: an empty network namespace (``unshare -n``)
where this machine allows it, and a seccomp filter in the child (x86-64 and aarch64 Linux: ``socket_seal``) that
makes ``socket()`` and ``connect()`` fail, which also cuts off named unix sockets (a file such as
/var/run/docker.sock, which a namespace does not); where neither is available, socket creation is blocked in
Python inside the child (``network_isolation`` says whether the namespace is used). Whatever happens, the caller gets a ``ToolResult`` whose ``text`` is
what the policy sees (``error: ...`` for a failure) and whose ``status`` is counted; no tool stops the run, and
a call the machine cannot start (no space, a failed fork) is an observation too (``infra``).

This contains a policy's mistakes (loops, huge allocations, floods of output, fork loops, network calls); it is
not a security boundary against deliberately malicious code (the kernel's own holes, and where Landlock or
seccomp is missing, blocks that can be undone from Python): run untrusted code in a container or VM as well.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
# "disk": the tool's files passed ``disk_mb``; "infra": the sandbox itself failed (no space for the working folder,
# a failed fork or exec of the child): not the tool's fault, counted apart (``envs/tool_health.py`` stops a run where
# every call fails so). Only the parent says "infra": a result line, which a tool that reads its caller's frames
# could forge, never does, so no policy can stop the run. A failure once the child runs (its keeper's fork) is a
# "crash".
Status = Literal["ok", "error", "timeout", "cpu", "memory", "output", "crash", "disk", "infra"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "cpu", "memory", "output", "crash", "disk", "infra")
NOBODY = 65534
ENTRY_BYTES = 4096  # what a file or folder counts at least against ``disk_mb``: an inode and a block


@dataclasses.dataclass(frozen=True)
class ToolLimits:
    """What one tool call may use. ``memory_mb`` bounds the child's address space, Python's own ~30 MB
    included; ``output_bytes`` bounds everything it writes (prints and result)."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    output_bytes: int = 16384
    max_procs: int = 32
    file_mb: int = 16
    # all the files of the call together (``file_mb`` bounds each): the parent watches the working folder's size,
    # the only place a tool writes where the kernel has Landlock, and ends the call once it is past this
    disk_mb: int = 64
    # where the kernel has Landlock, a tool reads only the Python installation, system directories, its working
    # directory and these (absolute paths: a lookup table, a corpus); never the run's data, checkpoints or secret
    read_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "max_procs", "file_mb", "disk_mb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"ToolLimits.{name} must be a positive number, got {v!r}")
        paths = self.read_paths
        if isinstance(paths, str) or not isinstance(paths, (list, tuple)) or \
                not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
            raise ValueError(f"ToolLimits.read_paths must be a list of absolute paths, got {paths!r}")
        object.__setattr__(self, "read_paths", tuple(paths))
        if not isinstance(self.cpu_s, int):
            raise ValueError(f"ToolLimits.cpu_s must be a whole number of seconds, got {self.cpu_s!r}")

    @classmethod
    def of(cls, where: str, value: object) -> "ToolLimits":
        """From a dict of ``interface_args`` (or a ToolLimits), with one clear error naming ``where``."""
        if isinstance(value, ToolLimits):
            return value
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"{where}: limits must be a dict of ToolLimits fields, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(value) - known)
        if bad:
            raise ValueError(f"{where}: unknown tool limit(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str  # the observation the policy sees
    status: Status
    seconds: float


@functools.lru_cache(maxsize=1)  # a fact about this machine, probed once per process
def network_isolation() -> Literal["namespace", "socket_block"]:
    """``namespace`` when ``unshare -n`` works here (root, or unprivileged user namespaces), else
    ``socket_block``."""
    exe = shutil.which("unshare")
    if exe is not None:
        try:
            ok = subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return "namespace"
    return "socket_block"


@functools.lru_cache(maxsize=1)
def socket_seal() -> bool:
    """Whether the child can install its seccomp socket filter here (``child.socket_filter``): Linux on x86-64
    or aarch64 with seccomp (``PR_GET_SECCOMP`` answers). Without it, a tool in an empty network namespace can
    still connect to a named unix socket it can see, and without the namespace too only a Python-level block
    (which ctypes undoes) stands between a tool and the network."""
    from realloc.tools.child import socket_filter

    if sys.platform != "linux" or socket_filter(os.uname().machine) is None:
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(21, 0, 0, 0, 0) >= 0  # PR_GET_SECCOMP: -1 without seccomp
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """This kernel's Landlock ABI version (0: none). From 1 (Linux 5.13) a tool's file access is confined
    (``ToolLimits.read_paths``); from 6 (Linux 6.12) its signals reach only its own processes."""
    if sys.platform != "linux":
        return 0
    import ctypes

    try:
        return max(0, ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1))  # LANDLOCK_CREATE_RULESET_VERSION
    except (OSError, AttributeError):
        return 0


def file_isolation() -> bool:
    """Whether a tool's file access is confined here (``landlock_abi() >= 1``)."""
    return landlock_abi() >= 1


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """Runs tool calls under ``limits``; ``isolation`` from ``network_isolation()`` (probe once, reuse)."""

    limits: ToolLimits = ToolLimits()
    isolation: Literal["namespace", "socket_block"] = "socket_block"

    @classmethod
    def probe(cls, limits: ToolLimits = ToolLimits()) -> "Sandbox":
        return cls(limits, network_isolation())

    def run(self, fn: str, text: str, arguments: dict | None = None) -> ToolResult:
        """Call tool ``fn`` ("module:function") on ``text`` in a fresh contained process (with ``arguments``: as
        ``fn(**arguments)``, a tool described by its signature, ``tools/declared.py``)."""
        start = time.monotonic()
        status, observation = self._run(fn, text, arguments)
        # text, always: a tool's result can carry lone surrogates (JSON's "\ud800"), which no tokenizer takes
        observation = observation.encode("utf-8", errors="replace").decode("utf-8")
        return ToolResult(observation, status, time.monotonic() - start)

    def _command(self) -> list[str]:
        cmd = [sys.executable, "-I", CHILD]
        return ["unshare", "-n", *cmd] if self.isolation == "namespace" else cmd

    def _run(self, fn: str, text: str, arguments: dict | None = None) -> tuple[Status, str]:
        lim = self.limits
        marker = "\x00realloc-tool-result-" + os.urandom(8).hex()
        drop_root = os.geteuid() == 0
        req = {"marker": marker, "fn": fn, "text": text, "path": [p for p in sys.path if p], "cpu_s": lim.cpu_s,
               "memory_bytes": lim.memory_mb << 20, "file_bytes": lim.file_mb << 20, "max_procs": lim.max_procs,
               "drop_root": drop_root, "block_network": self.isolation != "namespace", "parent": os.getpid(),
               "read_paths": list(lim.read_paths)}
        if arguments is not None:
            req["arguments"] = arguments
        work = ""
        try:
            # The machine's failures, not the tool's (no space for the folder, EAGAIN on fork, a failed exec): an
            # observation, counted as "infra"; a run where every call fails so stops (envs/tool_health.py).
            try:
                work = tempfile.mkdtemp(prefix="realloc-tool-")
                if drop_root:
                    os.chown(work, NOBODY, NOBODY)
                # A minimal environment: none of the run's variables (its secret among them) reach the tool.
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work,
                       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
                proc = subprocess.Popen(self._command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True)
            except OSError as e:
                return "infra", f"error: the tool could not be started: {type(e).__name__}: {e}"
            try:
                return self._watch(proc, json.dumps(req).encode(), marker, work)
            finally:
                if proc.returncode is None:  # not reaped yet: the group id is still this call's
                    _end(proc.pid)
                    proc.wait()
                assert proc.stdout is not None and proc.stdin is not None
                proc.stdout.close()
                proc.stdin.close()
        finally:
            if work:
                _remove(work)

    def _watch(self, proc: subprocess.Popen, request: bytes, marker: str, work: str) -> tuple[Status, str]:
        lim = self.limits
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(request)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + lim.wall_s
        budget = lim.output_bytes + len(marker) + 4096  # the result line is not the tool's output
        buf = bytearray()
        exited = False
        disk = lim.disk_mb << 20
        while True:
            if _used_bytes(work, disk) > disk:
                return "disk", _disk_error(lim)
            if not exited and _has_exited(proc.pid):
                # The tool's own process ended: its group goes now (forked children keep the pipe open).
                exited = True
                _kill_group(proc.pid)
            left = deadline - time.monotonic()
            if left <= 0 and not exited:
                return "timeout", f"error: the tool ran past its wall-time limit of {lim.wall_s:g} s and was stopped"
            ready, _, _ = select.select([fd], [], [], 0.02 if exited else min(left, 0.05))
            if not ready:
                if exited:
                    break
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break
            buf += chunk
            if len(buf) > budget:
                return "output", f"error: the tool wrote more than {lim.output_bytes} bytes of output and was stopped"
        proc.wait()
        if _used_bytes(work, disk) > disk:  # written between the last look and the end
            return "disk", _disk_error(lim)
        return _verdict(proc.returncode, buf.decode("utf-8", errors="replace"), marker, lim)


def _disk_error(lim: ToolLimits) -> str:
    return f"error: the tool wrote more than {lim.disk_mb} MB of files and was stopped"


def _used_bytes(root: str, cap: int) -> int:
    """What the files under ``root`` take on disk (allocated blocks: a sparse file counts what it fills; each file
    or folder at least ``ENTRY_BYTES``, since empty files fill a disk's inodes), counted until past ``cap``. A file the tool deleted but keeps open is not seen (``RLIMIT_FSIZE`` still bounds it)."""
    total, folders = 0, [root]
    while folders and total <= cap:
        folder = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except PermissionError:  # a folder the tool made unreadable (chmod 000) to hide what it holds: open it
            try:
                os.chmod(folder, 0o700)
                entries = list(os.scandir(folder))
            except OSError:
                continue
        except OSError:
            continue
        for e in entries:
            try:
                total += max(e.stat(follow_symlinks=False).st_blocks * 512, ENTRY_BYTES)
                if e.is_dir(follow_symlinks=False):
                    folders.append(e.path)
            except OSError:  # gone since the listing
                continue
    return total


def _remove(work: str) -> None:
    """The call's working folder, folders the tool made unreadable or unwritable (which ``rmtree`` leaves)
    included: each is opened (the parent owns it, or is root) and removed once more."""
    seen: set[str] = set()

    def reopen(_fn: object, path: str, _exc: object) -> None:
        if path in seen:
            return
        seen.add(path)
        for p in (os.path.dirname(path), path):
            try:
                os.chmod(p, 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=reopen)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass

    shutil.rmtree(work, onerror=reopen)


def _verdict(rc: int, out: str, marker: str, lim: ToolLimits) -> tuple[Status, str]:
    head, found, tail = out.partition("\n" + marker + " ")
    printed = head if found else out
    if len(printed.encode()) > lim.output_bytes:
        return "output", f"error: the tool wrote more than {lim.output_bytes} bytes of output and was stopped"
    if rc == -signal.SIGXCPU:
        return "cpu", f"error: the tool ran past its CPU-time limit of {lim.cpu_s} s and was stopped"
    if not found:
        return "crash", (printed + "\n" if printed else "") + f"error: the tool's process ended without a result " \
                        f"({_how(rc)})"
    try:
        res = json.loads(tail.split("\n", 1)[0])
    except ValueError:
        return "crash", "error: the tool's result could not be read"
    if not isinstance(res, dict) or not isinstance(res.get("value", ""), str):  # a line the tool forged itself
        return "crash", "error: the tool's result could not be read"
    if res.get("ok"):
        return "ok", printed + res.get("value", "")
    status: Status = "memory" if res.get("memory") else "error"
    return status, (printed + "\n" if printed else "") + "error: " + str(res.get("error", "unknown"))


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _has_exited(pid: int) -> bool:
    """Whether the tool's process has ended, without reaping it (its pid, the group's id, stays ours)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _end(pid: int) -> None:
    """End a call still running: SIGTERM asks the child's keeper (``child._keep``) to kill every process of the
    tool's, those in sessions of their own included; its group is killed after it has answered, or after 2 s."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 2.0
    while not _has_exited(pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    _kill_group(pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
