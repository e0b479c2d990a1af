"""The zygote: both ends of its protocol (as CPython's ``multiprocessing/forkserver.py``).

The zygote is a fresh interpreter (never a fork of the caller, which may have threads)
that imports the decoders once and stays single-threaded, so forking a sandbox from it
is safe and takes milliseconds. Each sandbox leads its own process group, so one
SIGKILL to the group also stops helpers such as an ffmpeg child stuck on a FIFO.
Neither outlives the caller: the zygote exits on EOF of its control socket after
killing its sandboxes, and a sandbox gets SIGKILL when the zygote dies.

Caller side: :class:`Zygote` starts the zygote and asks it, over the control socket,
to fork a sandbox (``SPAWN``: the reply carries the sandbox's pid and its socket) or
to reap one after the caller killed it (``REAP``: wait status and peak RSS).
Zygote side: :func:`zygote_main`. What runs inside a sandbox is :mod:`.sandbox`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time

from . import config, confine, sandbox, transport

log = logging.getLogger("swift_safe_media")

# -- the wire -------------------------------------------------------------------------
SPAWN, REAP = b"S", b"R"
CONTROL_REQUEST = struct.Struct("!cQ")  # op, memory cap in MB (SPAWN) or pid (REAP)
SPAWN_REPLY = struct.Struct("!q")  # pid; the sandbox's socket rides along (SCM_RIGHTS)
REAP_REPLY = struct.Struct("!qq")  # wait status, peak RSS in KiB
READY = struct.Struct("!q")  # the zygote's pid, once it has preloaded

_PREP_ENV = "_SWIFT_SAFE_MEDIA_PREP"  # the preparation, for a sandbox started by exec


class SandboxHandle:
    """The caller's end of one sandbox: its pid, its socket, its lent shared blocks."""

    def __init__(self, pid: int, conn: socket.socket, memory_cap_mb: int = 0):
        self.pid, self.conn, self.memory_cap_mb = pid, conn, memory_cap_mb
        self.blocks = transport.MappedBlocks()
        self.setups_done = 0  # how many of the pool's sandbox setups have run here

    def hand_back_blocks(self, deadline) -> None:
        """Tell the sandbox which of its arena blocks no array here views any more."""
        ids = []
        while self.blocks.returned:
            ids.append(self.blocks.returned.pop())
        if ids:
            transport.send(self.conn, transport.RETURN_BLOCKS, ids, deadline)

    def is_alive(self) -> bool:
        """An idle sandbox never writes: anything readable means it closed or died."""
        import select

        readable, _, _ = select.select([self.conn], [], [], 0)
        return not readable

    def kill(self) -> None:
        """Kill the sandbox's whole process group and close our end (reap with the zygote)."""
        kill_group(self.pid)
        self.conn.close()


# -- caller side ----------------------------------------------------------------------
class Zygote:
    def __init__(self, start_timeout: float, confined: bool = True):
        caller_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = f"from swift_safe_media.zygote import zygote_main; zygote_main({zygote_end.fileno()})"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=[zygote_end.fileno()], env=_zygote_environment(),
            # `-c` puts the working directory first on sys.path: a `swift_safe_media/` folder
            # there must not stand in for the package the caller imported (on PYTHONPATH).
            cwd=NEUTRAL_DIRECTORY, stdin=subprocess.DEVNULL, close_fds=True)
        zygote_end.close()
        self.control = caller_end
        deadline = time.monotonic() + start_timeout
        try:
            transport.send(self.control, transport.REQUEST, preparation(confined), deadline)
            self._read(READY.size, deadline)
        except BaseException:
            self.close()
            raise

    def _read(self, size, deadline):
        return transport.receive_exactly(self.control, size, deadline)

    def spawn(self, memory_cap_mb: int, deadline: float) -> SandboxHandle:
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(CONTROL_REQUEST.pack(SPAWN, memory_cap_mb))
        head, fds, _, _ = socket.recv_fds(self.control, SPAWN_REPLY.size, 1)
        if not fds:
            raise EOFError("the zygote sent no sandbox")
        head += self._read(SPAWN_REPLY.size - len(head), deadline)
        (pid,) = SPAWN_REPLY.unpack(head)
        return SandboxHandle(pid, socket.socket(fileno=fds[0]), memory_cap_mb)

    def reap(self, pid: int, deadline: float) -> tuple[int, int]:
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(CONTROL_REQUEST.pack(REAP, pid))
        return REAP_REPLY.unpack(self._read(REAP_REPLY.size, deadline))

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def close(self, wait: float = 2.0) -> None:
        self.control.close()  # EOF tells the zygote to kill its sandboxes and exit
        try:
            self.process.wait(wait)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def abandon(self) -> None:
        """In a forked child: the zygote belongs to the parent; drop our copies only."""
        self.control.close()
        self.process.returncode = 0  # keeps Popen.__del__ from tracking the parent's child


def _zygote_environment() -> dict:
    env = dict(os.environ)
    # The budget is resolved here, where the DataLoader's worker count is known, and each
    # sandbox sizes its pools to it after the fork; the zygote imports with pools of one
    # thread, since a pool started at import would leave it unsafe to fork.
    env.update({name: "1" for name in config.THREAD_ENV_VARS})
    env[config.THREADS] = str(config.decoder_threads())
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    return env


def preparation(confined: bool = True) -> dict:
    """What the zygote needs of the caller: its import path, argv, directory and main
    module, and whether its sandboxes are confined."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    main_name = spec.name if spec is not None and spec.name != "__main__" else None
    main_path = getattr(main, "__file__", None)
    return {
        "sys_path": list(sys.path),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "main": {"name": main_name, "path": None if main_name else main_path},
        "preload": config.preload_modules(),
        "confine": confined,
        "read_roots": config.read_roots(),
    }


# -- zygote side ----------------------------------------------------------------------
def zygote_main(control_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = socket.socket(fileno=control_fd)
    _, prep = transport.receive(control)
    _apply_preparation(prep)
    _preload(prep["preload"])
    policy = _prepare_confinement(prep)
    control.sendall(READY.pack(os.getpid()))
    children: set[int] = set()
    try:
        while True:
            try:
                request = transport.receive_exactly(control, CONTROL_REQUEST.size)
            except (EOFError, ConnectionError):
                break
            op, value = CONTROL_REQUEST.unpack(request)
            if op == SPAWN:
                pid, caller_end = _start_sandbox(control, prep, value, policy)
                children.add(pid)
                socket.send_fds(control, [SPAWN_REPLY.pack(pid)], [caller_end.fileno()])
                caller_end.close()
            elif op == REAP:
                children.discard(value)
                kill_group(value)
                control.sendall(REAP_REPLY.pack(*reap(value)))
    finally:
        # The caller is gone or done: nothing of ours may outlive it.
        for pid in children:
            kill_group(pid)
        for pid in children:
            reap(pid)
        os._exit(0)


# Where zygote and sandboxes run: not the caller's directory, so nothing a decoder
# resolves against the working directory (a playlist's relative entry, say) lands among
# the caller's files. Inputs reach the sandbox as absolute paths (decoders.inputs).
NEUTRAL_DIRECTORY = "/"


def _apply_preparation(prep: dict) -> None:
    cwd = prep["cwd"]
    # The caller's relative import paths ("" among them) and script keep meaning what they
    # meant there once this process leaves that directory.
    sys.path[:] = [os.path.join(cwd, entry) for entry in prep["sys_path"]]
    sys.argv[:] = prep["argv"]
    main = dict(prep["main"] or {})
    if main.get("path"):
        main["path"] = os.path.join(cwd, main["path"])
    try:
        os.chdir(NEUTRAL_DIRECTORY)
    except OSError:
        pass
    sandbox.remember_caller_main(main)


def _prepare_confinement(prep: dict) -> confine.Policy | None:
    """Built once here, after the imports (which may write caches), applied in each sandbox."""
    if not prep["confine"]:
        return None
    main_path = prep["main"].get("path")
    return confine.prepare(prep["read_roots"], [os.path.dirname(main_path)] if main_path else [])


def _preload(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional decoder must not stop the sandbox
            log.debug("swift_safe_media: preload of %s skipped: %s", name, exc)


def _fork_is_safe() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return True


def _start_sandbox(control, prep, memory_cap_mb, policy):
    caller_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if not _fork_is_safe():
        # A preloaded module started a thread: forking now could deadlock the child.
        log.warning("swift_safe_media: the zygote has threads; starting sandboxes by exec")
        pid = _exec_sandbox(sandbox_end, prep, memory_cap_mb)
        sandbox_end.close()
        return pid, caller_end
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            caller_end.close()
            sandbox.become_sandbox(sandbox_end, memory_cap_mb, zygote, policy)
        finally:
            os._exit(70)
    sandbox_end.close()
    return pid, caller_end


def _exec_sandbox(sandbox_end, prep, memory_cap_mb) -> int:
    env = dict(os.environ, **{_PREP_ENV: json.dumps(prep)})
    os.set_inheritable(sandbox_end.fileno(), True)
    code = (f"from swift_safe_media.zygote import exec_sandbox_main; "
            f"exec_sandbox_main({sandbox_end.fileno()}, {memory_cap_mb}, {os.getpid()})")
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], env)


def exec_sandbox_main(fd: int, memory_cap_mb: int, parent: int) -> None:
    prep = json.loads(os.environ.pop(_PREP_ENV))
    _apply_preparation(prep)
    _preload(prep["preload"])
    try:
        sandbox.become_sandbox(socket.socket(fileno=fd), memory_cap_mb, parent, _prepare_confinement(prep))
    finally:
        os._exit(70)


# -- both sides -----------------------------------------------------------------------
def kill_group(pid: int) -> None:
    """SIGKILL a sandbox's process group (it leads one: helpers it started go too)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reap(pid: int) -> tuple[int, int]:
    """Wait for a child of this process: (wait status, peak RSS in KiB), or (-1, 0)."""
    try:
        _, status, usage = os.wait4(pid, 0)
        return status, usage.ru_maxrss
    except ChildProcessError:
        return -1, 0
