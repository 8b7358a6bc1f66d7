"""The child side of a tool call (``sandbox.py`` is the parent): a fresh ``python -I`` runs this file by path.

Standard library only, and nothing imported before the limits are in place, so the tool starts small. It reads
one JSON request from stdin, makes the kernel refuse the tool's sockets (a seccomp filter: ``socket_filter``; where
there is none, a Python-level block, when the parent could not give it an empty network namespace either),
imports the tool's module, lowers its own resource limits, gives up root (to ``nobody``) when it has it and calls
the tool on the call's text. The tool runs in a child of the first process (the keeper, ``_keep``), which ends
every process the tool leaves behind when the call ends. Whatever the tool prints goes to stdout as it is written;
the result follows as one line ``<marker> <json>``, where the marker carries a nonce of this call so that printed
text cannot forge it. Where the kernel has Landlock, the tool's files and signals are confined too
(``_restrict_files``).
"""

import json
import os
import resource
import sys
import traceback

NOBODY = 65534


def _limit(which: int, value: int) -> None:
    resource.setrlimit(which, (value, value))


def _apply_limits(req: dict) -> None:
    """Lower this process's limits; as root, become nobody (after the tool's module is imported: a Python
    installed under a private home, as /root/.pyenv is, cannot be read by nobody)."""
    # CPU: the soft limit sends SIGXCPU (the parent reports it), the hard one a second later SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (req["cpu_s"], req["cpu_s"] + 1))
    _limit(resource.RLIMIT_AS, req["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, req["file_bytes"])
    _limit(resource.RLIMIT_CORE, 0)
    if req["drop_root"] and os.geteuid() == 0:
        # RLIMIT_NPROC binds only a user without CAP_SYS_RESOURCE: become nobody first, then the count holds.
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        _die_with_parent(req["parent"])  # a change of credentials clears the parent-death signal: set it again
    _limit(resource.RLIMIT_NPROC, req["max_procs"])
    _restrict_files(req.get("read_paths", []))


# Landlock (Linux >= 5.13): access rights of ABI 1, and the paths a tool may read (the Python it runs on, system
# libraries) besides its working directory; x86-64 and arm64 share the syscall numbers.
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR, _ALL_V1, _TRUNCATE = 1, 2, 4, 8, (1 << 13) - 1, 1 << 14
_SCOPE_UNIX, _SCOPE_SIGNAL = 1, 2  # abstract unix sockets and signals out of the tool's own processes
# /proc/self: the tool's own process (libraries read their status there), not the worker's /proc entries
_SYSTEM = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/proc/self", "/proc/cpuinfo", "/proc/meminfo")


def _restrict_files(extra: list) -> None:
    """Confine the tool's file access to reading (and executing) the Python installation, system directories and
    ``extra`` (``ToolLimits.read_paths``), and to its working directory: the run's data (the answers a reward
    checks), checkpoints and secret stay out of reach, whatever the user. Nothing where the kernel lacks Landlock."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return
    handled = _ALL_V1 | (_TRUNCATE if abi >= 3 else 0)
    # ABI 6 (Linux 6.12) scopes signals too: a tool's kill(-1, ...) reaches only its own processes, not every
    # process of its user (the worker and the master, or as nobody the other rollouts' tools)
    attr = struct.pack("=QQQ", handled, 0, _SCOPE_SIGNAL | _SCOPE_UNIX) if abi >= 6 else struct.pack("=Q", handled)
    ruleset = libc.syscall(444, attr, len(attr), 0)
    if ruleset < 0:
        return
    read = _EXECUTE | _READ_FILE | _READ_DIR
    paths = {p: read for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *_SYSTEM,
                               *extra)}
    for dev in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"):  # not all of /dev: /dev/shm holds the
        paths[dev] = _READ_FILE | _WRITE_FILE                                  # worker's shared memory
    paths[os.getcwd()] = handled
    for path, rights in paths.items():
        try:
            fd = os.open(path, os.O_PATH | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            if not os.path.isdir(path):
                rights &= _EXECUTE | _READ_FILE | _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)
            rule = struct.pack("=Qi", rights, fd)
            libc.syscall(445, ruleset, 1, rule, 0)  # landlock_add_rule(LANDLOCK_RULE_PATH_BENEATH)
        finally:
            os.close(fd)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: Landlock's precondition without CAP_SYS_ADMIN
    libc.syscall(446, ruleset, 0)  # landlock_restrict_self
    os.close(ruleset)


# The seccomp filter (``_seal_sockets``): seccomp_data is {int nr; u32 arch; u64 ip; u64 args[6]} (linux/seccomp.h).
# Per architecture (AUDIT_ARCH_*): its numbers of socket, connect, socketpair, and io_uring_setup (io_uring can
# open and connect sockets without those syscalls); x32 calls on x86-64 carry bit 30 in the number.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41, 42, 53, 425, True), "aarch64": (0xC00000B7, 198, 203, 199, 425, False)}
_LD_W_ABS, _JEQ_K, _JGE_K, _AND_K, _RET_K = 0x20, 0x15, 0x35, 0x54, 0x06  # BPF classic opcodes
_ALLOW, _DENY = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
_AF_UNIX, _SOCK_STREAM, _SOCK_SEQPACKET, _SOCK_TYPE_MASK = 1, 1, 5, 0xF


def socket_filter(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The seccomp-bpf program (code, jt, jf, k) that makes ``socket()``, ``connect()`` and ``io_uring_setup()``
    fail with EPERM and lets ``socketpair(AF_UNIX, SOCK_STREAM or SOCK_SEQPACKET)`` through: a pair connected to
    itself reaches nothing else (a stream or seqpacket unix socket ignores or refuses a send's address; a datagram
    one would send to a named socket, so it is refused too), and the standard library uses it
    (``multiprocessing.Pipe``, asyncio's wake-up pair). A call of another architecture (i386's ``int 0x80``, x32)
    fails alike. None where ``machine`` is not x86-64 or aarch64."""
    if machine not in _SECCOMP_ARCH:
        return None
    arch, sock, conn, pair, uring, x32 = _SECCOMP_ARCH[machine]
    # jt/jf: 0 (the next instruction) or a label, resolved to a relative jump below
    prog: list[tuple[int, object, object, int]] = [
        (_LD_W_ABS, 0, 0, 4), (_JEQ_K, 0, "deny", arch),  # another architecture's call
        (_LD_W_ABS, 0, 0, 0)]
    if x32:
        prog.append((_JGE_K, "deny", 0, 0x40000000))
    prog += [(_JEQ_K, "deny", 0, sock), (_JEQ_K, "deny", 0, conn), (_JEQ_K, "deny", 0, uring),
             (_JEQ_K, 0, "allow", pair),
             (_LD_W_ABS, 0, 0, 16), (_JEQ_K, 0, "deny", _AF_UNIX),  # args[0], low word: the family
             (_LD_W_ABS, 0, 0, 24), (_AND_K, 0, 0, _SOCK_TYPE_MASK),  # args[1] less SOCK_NONBLOCK, SOCK_CLOEXEC
             (_JEQ_K, "allow", 0, _SOCK_STREAM), (_JEQ_K, "allow", 0, _SOCK_SEQPACKET),
             (_RET_K, 0, 0, _DENY), (_RET_K, 0, 0, _ALLOW)]
    at = {"deny": len(prog) - 2, "allow": len(prog) - 1}

    def rel(i: int, target: object) -> int:
        return at[target] - i - 1 if isinstance(target, str) else int(target)  # type: ignore[call-overload]

    return [(code, rel(i, jt), rel(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog)]


def _seal_sockets() -> bool:
    """Install ``socket_filter`` on this process (inherited by every process it starts, and kept across exec and
    the switch to nobody): a tool can open no socket, through Python, ctypes or a program it runs, so neither
    the network nor a named unix socket (a file such as /var/run/docker.sock, which an empty network namespace
    does not cut off) is reachable. False where this architecture or kernel has no seccomp filters."""
    import ctypes
    import struct

    prog = socket_filter(os.uname().machine)
    if prog is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    code = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("@HP", len(prog), ctypes.addressof(filt))  # struct sock_fprog {u16 len; *filter}
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: seccomp's precondition without CAP_SYS_ADMIN
    return libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def _block_network() -> None:
    import socket

    def refuse(*_a: object, **_k: object) -> None:
        raise PermissionError("network access is disabled for tools")

    socket.socket = refuse  # type: ignore[assignment, misc]
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.socketpair = refuse  # type: ignore[assignment]
    import _socket
    _socket.socket = refuse  # type: ignore[assignment, misc]


def _die_with_parent(parent: int, sig: int = 9) -> None:
    """SIGKILL this process when its parent (the worker) dies: the tool leads a session of its own, so a killed
    worker's group does not reach it, and nobody would enforce its wall time (Linux; elsewhere nothing). The signal
    follows the thread that started this process, which waits for it in ``Sandbox.run`` until it ends."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG (SIGKILL by default)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the worker died before the signal was set
        os._exit(1)


def _error(e: BaseException) -> str:
    line = traceback.format_exception_only(type(e), e)[-1].strip()
    return line if len(line) <= 500 else line[:500] + "..."


def _answer(value: object) -> str:
    """The text the policy reads: a dict or list as JSON (a model reads JSON, not Python's repr), a string as it
    is, None as "", anything else (or a dict holding what JSON cannot write) as str()."""
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):  # a set inside, a non-string key, a cycle
            pass
    return str(value)


def _call_tool(req: dict) -> None:
    """The tool's process: run the tool under the limits and write the result line; never returns."""
    os.setpgid(0, 0)  # a group of its own, which the keeper kills as a whole
    if sys.platform == "linux":
        req = dict(req, parent=os.getppid())  # the keeper
        _die_with_parent(req["parent"])
    marker = req["marker"]
    try:
        sys.path[:] = req["path"]
        module, _, attr = req["fn"].partition(":")
        import importlib
        # seccomp where the kernel has it (whatever the namespace: it alone cuts off named unix sockets); the
        # Python-level block is the fallback where neither it nor an empty network namespace is available
        sealed = sys.platform == "linux" and _seal_sockets()
        if req["block_network"] and not sealed:
            _block_network()
        fn = getattr(importlib.import_module(module), attr)
        _apply_limits(req)
        value = fn(**req["arguments"]) if "arguments" in req else fn(req["text"])
        out = {"ok": True, "value": _answer(value)}
    except MemoryError:
        out = {"ok": False, "error": "MemoryError: the tool exceeded its memory limit", "memory": True}
    except BaseException as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt of the tool are its errors too)
        out = {"ok": False, "error": _error(e)}
    sys.stdout.flush()
    sys.stdout.write("\n" + marker + " " + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no atexit handlers or threads of the tool's


def _children() -> list[int]:
    """This process's children (orphans of the tool's processes are reparented here: see ``_keep``)."""
    me, out = os.getpid(), []
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc mounted: the parent's wall time ends the call, and only the tool's group dies
        return out
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == me:  # field 4, after "pid (comm) state"
                out.append(int(name))
    return out


def _end_all(tool: int) -> None:
    """Kill the tool's group, then every process left below this one (a daemon the tool started in a session
    of its own included: once its parent is gone it is this process's child), until none is left."""
    try:
        os.killpg(tool, 9)  # SIGKILL
    except OSError:
        pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue  # one more reaped (the tool's own process, in the usual case the only one)
        except ChildProcessError:
            return  # none left: no need to read /proc
        for pid in _children():  # some still run: kill them, reap one, look again
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _keep(req: dict) -> None:
    """The keeper: the tool runs in a child of this process, which is a child subreaper (Linux), so that every
    process the tool leaves behind, even in a session of its own (``setsid``, which a process-group kill does not
    reach), ends up this process's child and dies when the call ends; the parent's SIGTERM (wall time) ends the
    call the same way. The keeper exits as the tool's process did, so that the parent reads its status."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until the handler knows the tool's pid
    tool = os.fork()
    if tool == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _call_tool(req)

    def stop(*_a: object) -> None:
        _end_all(tool)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # Not reaped before its group is killed: until then the group's id cannot be another process's.
    info = os.waitid(os.P_PID, tool, os.WEXITED | os.WNOWAIT)
    _end_all(tool)
    if info is not None and info.si_code != os.CLD_EXITED:  # die of the same signal (SIGXCPU: the CPU limit)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if info.si_status != signal.SIGKILL:  # SIGKILL has no handler to reset
            signal.signal(info.si_status, signal.SIG_DFL)
        os.kill(os.getpid(), info.si_status)
    os._exit(info.si_status if info is not None and info.si_code == os.CLD_EXITED else 1)


def main() -> None:
    req = json.loads(sys.stdin.read(1 << 20))
    if sys.platform != "linux":
        _call_tool(req)
    _die_with_parent(req["parent"], 15)  # SIGTERM: the keeper ends the tool's processes, then itself
    _keep(req)


if __name__ == "__main__":
    main()
