"""The tool sandbox's seccomp socket filter (realloc/tools/child.py: socket_filter, _seal_sockets): a tool opens no
socket, through Python or ctypes, so a named unix socket it can see (which an empty network namespace does not cut
off) is out of reach too; socketpair, which the standard library builds on, still works."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

import pytest

from realloc.tools.child import _SECCOMP_ARCH, socket_filter
from realloc.tools.sandbox import Sandbox, ToolLimits, landlock_abi, network_isolation, socket_seal

LIMITS = ToolLimits(wall_s=6.0, cpu_s=2, memory_mb=256, output_bytes=4096, max_procs=8)
needs_seal = pytest.mark.skipif(not socket_seal() or platform.machine() != "x86_64",
                                reason="no seccomp socket filter here (or not x86-64, whose numbers the tools use)")


def _run_bpf(prog: list[tuple[int, int, int, int]], nr: int, arch: int, args: tuple[int, ...]) -> int:
    """A classic-BPF interpreter over the opcodes the filter uses, on a packed seccomp_data: the reference the
    filter is checked against on architectures this machine cannot run."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
            hit = acc == k if code == 0x15 else acc >= k
            pc += jt if hit else jf
        else:
            raise AssertionError(f"opcode {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(_SECCOMP_ARCH))
def test_the_filter_refuses_sockets_and_keeps_unix_stream_pairs_on_each_architecture(machine):
    prog = socket_filter(machine)
    assert prog is not None and len(prog) <= 4096  # BPF_MAXINSNS
    # linux's unistd tables: (socket, connect, socketpair, io_uring_setup, read, sendto)
    nrs = {"x86_64": (41, 42, 53, 425, 0, 44), "aarch64": (198, 203, 199, 425, 63, 206)}[machine]
    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[machine]
    sock, conn, pair, uring, read, sendto = nrs
    allow, eperm = 0x7FFF0000, 0x00050001
    for family in (1, 2, 10, 16, 17):  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET
        assert _run_bpf(prog, sock, arch, (family, 1, 0)) == eperm
    assert _run_bpf(prog, conn, arch, (3, 0, 110)) == eperm
    assert _run_bpf(prog, uring, arch, (4, 0)) == eperm
    assert _run_bpf(prog, pair, arch, (1, 1, 0)) == allow  # socket.socketpair()
    assert _run_bpf(prog, pair, arch, (1, 5 | 0o2000000 | 0o4000, 0)) == allow  # SEQPACKET | CLOEXEC | NONBLOCK
    assert _run_bpf(prog, pair, arch, (1, 2, 0)) == eperm  # a datagram pair can send to a named socket
    assert _run_bpf(prog, pair, arch, (2, 1, 0)) == eperm
    assert _run_bpf(prog, read, arch, (0, 0, 0)) == allow and _run_bpf(prog, sendto, arch, (3, 0, 0)) == allow
    assert _run_bpf(prog, sock, 0x40000003, (2, 1, 0)) == eperm  # i386 (int 0x80 on x86-64): refused whole
    if machine == "x86_64":
        assert _run_bpf(prog, sock | 0x40000000, arch, (2, 1, 0)) == eperm  # x32
        assert _run_bpf(prog, read | 0x40000000, arch, (0, 0, 0)) == eperm
    assert socket_filter("riscv64") is None and socket_filter("i686") is None


@pytest.fixture()
def unix_server():
    """A listening named unix socket that the tool could connect to but for the filter (as nobody too, when the
    test runs as root: in the temp folder, not under pytest's private tmp_path)."""
    folder = tempfile.mkdtemp(prefix="realloc-sock-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "db.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(4)
    server.setblocking(False)
    yield folder, path, server
    server.close()
    shutil.rmtree(folder)


def _accepted(server: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_an_empty_network_namespace_alone_does_not_cut_off_a_named_socket(unix_server):
    """The hole the filter closes: outside the sandbox, ``unshare -n`` still connects to the socket file."""
    if network_isolation() != "namespace" or shutil.which("unshare") is None:
        pytest.skip("unshare -n is not available here")
    _, path, server = unix_server
    code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({path!r}); print('connected')"
    out = subprocess.run(["unshare", "-n", sys.executable, "-I", "-c", code], capture_output=True, timeout=30)
    assert out.stdout.decode().strip() == "connected"
    assert _accepted(server) == 1


@needs_seal
@pytest.mark.parametrize("isolation", ["namespace", "socket_block"])
def test_a_tool_cannot_connect_to_a_named_unix_socket(unix_server, isolation):
    if isolation == "namespace" and network_isolation() != "namespace":
        pytest.skip("unshare -n is not available here")
    folder, path, server = unix_server
    sandbox = Sandbox(ToolLimits(**{**LIMITS.__dict__, "read_paths": (folder,)}), isolation)
    r = sandbox.run("socket_cases:connect_unix", path)
    assert r.status == "error" and "PermissionError: [Errno 1] Operation not permitted" in r.text, r.text
    # the python tool, through libc (as nobody it cannot import the socket module from a private home; ctypes is
    # loaded): socket(AF_UNIX) fails, and connect on what it returned too
    program = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(1, 1, 0)\n"
               "print('socket', fd, ctypes.get_errno())\n"
               f"addr = (1).to_bytes(2, 'little') + {path.encode()!r}.ljust(108, bytes(1))\n"
               "print('connect', libc.connect(fd, addr, len(addr)), ctypes.get_errno())")
    r = sandbox.run("realloc.tools.builtin:python", program)
    assert (r.status, r.text) == ("ok", "socket -1 1\nconnect -1 1\n"), r.text
    assert _accepted(server) == 0


@needs_seal
@pytest.mark.parametrize("isolation", ["namespace", "socket_block"])
def test_ctypes_and_raw_syscalls_cannot_open_a_socket(isolation):
    if isolation == "namespace" and network_isolation() != "namespace":
        pytest.skip("unshare -n is not available here")
    r = Sandbox(LIMITS, isolation).run("socket_cases:ctypes_inet", "")
    assert r.status == "ok", r.text
    assert r.text == "libc socket inet=-1/1 libc socket unix=-1/1 syscall socket inet=-1/1 io_uring_setup=-1/1"


@pytest.mark.parametrize("isolation", ["namespace", "socket_block"])
def test_the_standard_library_the_calculator_and_the_preloaded_modules_still_work(isolation):
    if isolation == "namespace" and network_isolation() != "namespace":
        pytest.skip("unshare -n is not available here")
    sandbox = Sandbox(LIMITS, isolation)
    if socket_seal():  # the Python-level fallback refuses socketpair too; the filter keeps it
        r = sandbox.run("socket_cases:stdlib_pairs", "ab")
        assert (r.status, r.text) == ("ok", "abab")
    r = sandbox.run("realloc.tools.builtin:calculator", "12*(3+4)")
    assert (r.status, r.text) == ("ok", "84")
    program = ("import math, json, fractions, statistics, itertools, collections, re, decimal\n"
               "print(math.comb(10, 3), json.dumps(sorted(collections.Counter('abca').items())),"
               " fractions.Fraction(3, 6), statistics.median([3, 1, 2]), re.sub('a', 'b', 'aa'),"
               " decimal.Decimal('0.1') + decimal.Decimal('0.2'), len(list(itertools.permutations(range(4)))))")
    r = sandbox.run("realloc.tools.builtin:python", program)
    assert (r.status, r.text) == ("ok", '120 [["a", 2], ["b", 1], ["c", 1]] 1/2 2 bb 0.3 24\n'), r.text


def test_a_tool_cannot_read_its_keepers_or_its_workers_proc_entries():
    """/proc/<pid>/environ holds a process's variables as it was started (a worker's $REALLOC_SECRET among them):
    Landlock leaves a tool only /proc/self, and as nobody (a root trainer) the worker's entries are not its own."""
    if landlock_abi() < 1 and os.geteuid() != 0:
        pytest.skip("without Landlock a tool of the run's own user reads them (documented in docs/multi-turn.md)")
    r = Sandbox(LIMITS, network_isolation()).run("socket_cases:proc_peek", "unused")
    assert r.status == "ok", r.text
    seen = dict(item.split("=") for item in r.text.split())
    assert seen["keeper/environ"] == seen["worker/environ"] == "PermissionError", r.text
    if landlock_abi() >= 1:
        assert set(seen.values()) == {"PermissionError"}, r.text  # cmdline and status too
