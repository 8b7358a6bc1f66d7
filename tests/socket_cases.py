"""Tools that reach for sockets, for tests/test_sandbox_sockets.py (imported by the sandbox's child by module path;
everything they use is imported here, before the child may become nobody)."""

import asyncio
import ctypes
import multiprocessing.connection
import os
import socket


def connect_unix(path: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"hello")
    return "connected"


def ctypes_inet(text: str) -> str:
    """socket(AF_INET) and socket(AF_UNIX) through libc and the raw syscall, and io_uring_setup: what each
    returned, with errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    nr = {"socket": 41, "io_uring_setup": 425}  # x86-64 (aarch64: 198, 425); the test runs on x86-64 only
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    calls = [("libc socket inet", lambda: libc.socket(2, 1, 0)), ("libc socket unix", lambda: libc.socket(1, 1, 0)),
             ("syscall socket inet", lambda: libc.syscall(nr["socket"], 2, 1, 0)),
             ("io_uring_setup", lambda: libc.syscall(nr["io_uring_setup"], 4, params))]
    out = []
    for name, call in calls:
        ctypes.set_errno(0)
        out.append(f"{name}={call()}/{ctypes.get_errno()}")
    return " ".join(out)


def stdlib_pairs(text: str) -> str:
    """What the standard library builds on socketpair still works: a pair, a duplex multiprocessing Pipe and an
    asyncio event loop (its wake-up pair)."""
    a, b = socket.socketpair()
    a.sendall(text.encode())
    got = b.recv(64).decode()
    r, w = multiprocessing.connection.Pipe()
    w.send(got)

    async def twice(x: str) -> str:
        await asyncio.sleep(0)
        return x * 2

    return asyncio.run(twice(r.recv()))


def proc_peek(text: str) -> str:
    """What this tool can read of its keeper's and of the worker's (the keeper's parent's) /proc entries."""
    keeper = os.getppid()
    worker = keeper
    out = []
    try:
        with open(f"/proc/{keeper}/status") as f:
            worker = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    except OSError as e:
        out.append(f"keeper/status={type(e).__name__}")
    for who, pid in (("keeper", keeper), ("worker", worker)):
        for entry in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{entry}", "rb") as f:
                    data = f.read()
                out.append(f"{who}/{entry}={'secret' if text.encode() in data else 'read'}")
            except OSError as e:
                out.append(f"{who}/{entry}={type(e).__name__}")
    return " ".join(out)
