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

import gc
import importlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from . import config, confine, process, sandbox, transport

log = logging.getLogger("swift_safe_media")

# -- the wire -------------------------------------------------------------------------
SPAWN, REAP = b"S", b"R"
# op, memory cap in MB (SPAWN) or pid (REAP), then that many bytes (SPAWN: JSON of the
# caller's environment, which the new sandbox takes as its own)
CONTROL_REQUEST = struct.Struct("!cQI")
SPAWN_REPLY = struct.Struct("!q")  # pid; the sandbox's socket rides along (SCM_RIGHTS)
REAP_REPLY = struct.Struct("!qq")  # wait status, peak RSS in KiB
READY = struct.Struct("!qq")  # the zygote's pid and its parent's thread count, once it has preloaded
REQUEST_TIMEOUT_S = 5.0  # a caller sends a request whole; one that stalls mid-request is dropped

_PREP_ENV = "_SWIFT_SAFE_MEDIA_PREP"  # the preparation, for a sandbox started by exec
# Set by the warm forkserver (:mod:`.warm_start`) for what it forks: its own thread count
# after its imports, which the zygote it forks reports in READY (more than 1: unsafe).
PARENT_THREADS_ENV = "_SWIFT_SAFE_MEDIA_FORKSERVER_THREADS"


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
        return _peer_open(self.conn)

    def kill(self) -> None:
        """Kill the sandbox's whole process group and close our end (reap with the zygote)."""
        kill_group(self.pid)
        self.conn.close()


# -- caller side ----------------------------------------------------------------------
class Zygote:
    """The caller's connection to a zygote: its own (started here, ``Zygote(...)``) or
    the one its rank shares with its DataLoader workers (``Zygote.connect(address)``)."""

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

    @classmethod
    def connect(cls, address: str) -> "Zygote":
        """A connection to a shared zygote (``OSError`` if nobody listens there any more).
        Its sandboxes die when this connection closes: with this process, say."""
        client = cls.__new__(cls)
        client.process = None
        client.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.control.connect(address)
        except BaseException:
            client.control.close()
            raise
        return client

    def _read(self, size, deadline):
        return transport.receive_exactly(self.control, size, deadline)

    def spawn(self, memory_cap_mb: int, deadline: float) -> SandboxHandle:
        environment = json.dumps(_environment_for_sandbox()).encode()
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(CONTROL_REQUEST.pack(SPAWN, memory_cap_mb, len(environment)) + environment)
        head, fds, _, _ = socket.recv_fds(self.control, SPAWN_REPLY.size, 1)
        if not fds:
            raise EOFError("the zygote sent no sandbox")
        head += self._read(SPAWN_REPLY.size - len(head), deadline)
        (pid,) = SPAWN_REPLY.unpack(head)
        return SandboxHandle(pid, socket.socket(fileno=fds[0]), memory_cap_mb)

    def reap(self, pid: int, deadline: float) -> tuple[int, int]:
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(CONTROL_REQUEST.pack(REAP, pid, 0))
        return REAP_REPLY.unpack(self._read(REAP_REPLY.size, deadline))

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return _peer_open(self.control)  # a zygote writes only replies: between requests, EOF

    def close(self, wait: float = 2.0) -> None:
        self.control.close()  # EOF tells the zygote to kill this connection's sandboxes
        if self.process is None:
            return
        try:
            self.process.wait(wait)  # its own zygote exits too
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def abandon(self) -> None:
        """In a forked child: the zygote belongs to the parent; drop our copies only."""
        self.control.close()
        if self.process is not None:
            self.process.returncode = 0  # keeps Popen.__del__ from tracking the parent's child


class SharedZygote:
    """The owner's end of the zygote a training process (a rank) shares with its DataLoader
    workers, whatever their start method: one zygote per rank instead of one per worker,
    started early (see :mod:`.warm_start`) so its imports are done by the first batch.

    Callers reach it through a Unix socket in a private folder, named in the internal
    setting ``SWIFT_SAFE_MEDIA_ZYGOTE`` (inherited by workers); each still gets its own
    sandboxes, timeouts and errors. The listening socket exists before the zygote does,
    so a worker may connect at once: its first request waits for the zygote's imports.
    The owner's control connection holds the zygote's life: it ends with the owner."""

    def __init__(self, confined: bool):
        self.confined = confined
        self.folder = _private_folder()  # mode 0700
        self.address = os.path.join(self.folder, "zygote.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(256)
        self.control, self._zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = None
        self.pid: int | None = None
        self.problem: str | None = None  # why it is not serving, once it is known
        self.parent_problem: str | None = None  # why the process it was forked from is unsafe
        self.started_by = None  # what starts its process (see start)
        self.ready = threading.Event()
        self._owner = os.getpid()
        self._closed = False
        config.put(config.ZYGOTE, f"{'confined' if confined else 'unconfined'}:{self.address}")

    def start(self, start_process=None) -> None:
        """Start the zygote in the background: ``start_process(zygote_end, listener)``
        returns its process (by default, one started by exec)."""
        self.started_by = start_process or _popen_zygote
        threading.Thread(target=self._start, args=(self.started_by,), name="swift-safe-media-zygote-start",
                         daemon=True).start()

    def _start(self, start_process) -> None:
        deadline = time.monotonic() + config.start_timeout()
        try:
            if self._closed:  # closed before this thread ran (enable() refused the run)
                raise EOFError
            self.process = start_process(self._zygote_end, self._listener)
            self._zygote_end.close()
            self._listener.close()  # the zygote holds it now: if it dies, callers are refused
            transport.send(self.control, transport.REQUEST, preparation(self.confined), deadline)
            self.pid, parent_threads = READY.unpack(transport.receive_exactly(self.control, READY.size, deadline))
            if parent_threads > 1:
                self.parent_problem = f"the process it was forked from has {parent_threads} threads"
                raise RuntimeError(self.parent_problem)
        except BaseException as exc:
            self.problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not self._closed:
                    log.warning("swift_safe_media: the shared zygote could not start (%s); each process "
                            "starts its own", self.problem)
            self.close()
        finally:
            self.ready.set()

    def close(self) -> None:
        """Stop the zygote and its sandboxes (callers then start zygotes of their own)."""
        if os.getpid() != self._owner:
            return
        self._closed = True
        if config.get(config.ZYGOTE) == f"{'confined' if self.confined else 'unconfined'}:{self.address}":
            config.put(config.ZYGOTE, None)
        for sock in (self._listener, self._zygote_end, self.control):
            sock.close()
        if self.process is not None:
            try:
                self.process.wait(2.0) if hasattr(self.process, "wait") else self.process.join(2.0)
            except subprocess.TimeoutExpired:
                pass
            if _running(self.process):
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def abandon(self) -> None:
        """In a forked child: the zygote is the parent's; drop our copies of its sockets."""
        for sock in (self._listener, self._zygote_end, self.control):
            sock.close()
        if isinstance(self.process, subprocess.Popen):
            self.process.returncode = 0


# A Unix socket's path has at most 107 bytes; a long TMPDIR (a job scheduler's, a test's)
# leaves no room, so the folder then goes where it fits.
_SOCKET_PATH_MAX = 107 - len("/zygote.sock")


def _private_folder() -> str:
    for base in (None, "/tmp", "/dev/shm"):
        parent = tempfile.gettempdir() if base is None else base
        if len(os.path.join(parent, "swift-safe-media-zygote-12345678")) <= _SOCKET_PATH_MAX:
            return tempfile.mkdtemp(prefix="swift-safe-media-zygote-", dir=parent)
    raise OSError("no temporary folder with a path short enough for a Unix socket")


def _running(child) -> bool:
    if isinstance(child, subprocess.Popen):
        return child.poll() is None
    return child.is_alive()


def _popen_zygote(zygote_end: socket.socket, listener: socket.socket):
    """A zygote started by exec (without the warm forkserver)."""
    fds = (zygote_end.fileno(), listener.fileno())
    code = f"from swift_safe_media.zygote import zygote_main; zygote_main({fds[0]}, {fds[1]})"
    return subprocess.Popen([sys.executable, "-c", code], pass_fds=fds, env=_zygote_environment(),
                            cwd=NEUTRAL_DIRECTORY, stdin=subprocess.DEVNULL, close_fds=True)


def shared_address(confined: bool) -> str | None:
    """The socket of this rank's shared zygote for sandboxes of this kind, if there is one."""
    value = config.get(config.ZYGOTE)
    if not value:
        return None
    kind, _, address = value.partition(":")
    return address if kind == ("confined" if confined else "unconfined") else None


def _environment_for_sandbox() -> dict:
    """The caller's environment, which a sandbox takes instead of the zygote's: the caller
    may have changed it since the zygote started (a shared zygote starts at ``enable()``),
    and the thread budget is resolved here, where the DataLoader's worker count is known."""
    environment = {name: value for name, value in os.environ.items() if name != config.ZYGOTE}
    environment[config.THREADS] = str(config.decoder_threads())
    # Pools are sized by that budget after the fork (sandbox._limit_threads); a library a
    # sandbox imports later starts with one thread, as in the zygote.
    environment.update({name: "1" for name in config.THREAD_ENV_VARS})
    return environment


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
def zygote_main(control_fd: int, listener_fd: int = -1) -> None:
    """Serve the caller on ``control_fd`` and, for a shared zygote, every process that
    connects to ``listener_fd``. Each connection's sandboxes die when it closes; all of
    them, and the zygote, when the control connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    process.set_name(process.ZYGOTE_NAME)
    control = socket.socket(fileno=control_fd)
    listener = socket.socket(fileno=listener_fd) if listener_fd >= 0 else None
    try:
        _, prep = transport.receive(control)
    except (EOFError, OSError):  # the caller ended before the zygote started
        os._exit(0)
    _apply_preparation(prep)
    preload(prep["preload"], lambda: _peer_open(control))
    policy = _prepare_confinement(prep)
    gc.collect()
    gc.freeze()  # the sandboxes' collections leave the preloaded objects (and their pages) alone
    control.sendall(READY.pack(os.getpid(), int(os.environ.get(PARENT_THREADS_ENV, "1"))))
    clients: dict[socket.socket, set[int]] = {control: set()}  # connection -> its sandboxes
    unreaped: set[int] = set()  # killed, not yet collected (a process in D state, say)
    try:
        while True:
            waiting = [*clients, listener] if listener is not None else list(clients)
            readable, _, _ = select.select(waiting, [], [], 1.0 if unreaped else None)
            unreaped = {pid for pid in unreaped if not _collected(pid)}
            for conn in readable:
                if conn is listener:
                    _accept(listener, clients)
                    continue
                try:
                    _serve_request(conn, clients[conn], prep, policy, unreaped, waiting)
                except (EOFError, OSError):  # the caller is gone (or broke the protocol)
                    if conn is control:
                        return
                    _end_client(conn, clients.pop(conn), unreaped)
    finally:
        # The caller is gone or done: nothing of ours may outlive it.
        for children in clients.values():
            for pid in children:
                kill_group(pid)
        for children in clients.values():
            for pid in children:
                reap(pid)
        os._exit(0)


def _peer_open(conn) -> bool:
    """False once the peer of an idle connection (one it never writes on unasked: a sandbox
    between calls, a zygote between requests, a caller before READY) closed or died."""
    readable, _, _ = select.select([conn], [], [], 0)
    return not readable


def _accept(listener, clients) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():  # the folder is private; this is the second lock on the door
        conn.close()
        return
    clients[conn] = set()


def _serve_request(conn, children: set[int], prep, policy, unreaped: set[int], ours) -> None:
    """One request of one connection; ``ours``: every socket of the zygote (no sandbox keeps one)."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    op, value, size = CONTROL_REQUEST.unpack(transport.receive_exactly(conn, CONTROL_REQUEST.size, deadline))
    environment = json.loads(bytes(transport.receive_exactly(conn, size, deadline))) if size else {}
    conn.settimeout(REQUEST_TIMEOUT_S)
    if op == SPAWN:
        pid, caller_end = _start_sandbox(ours, prep, value, policy, environment)
        children.add(pid)
        try:
            socket.send_fds(conn, [SPAWN_REPLY.pack(pid)], [caller_end.fileno()])
        finally:
            caller_end.close()
    elif op == REAP and value in children:  # only a connection's own sandboxes
        children.discard(value)
        kill_group(value)
        status, peak = reap(value, block=False)
        if status == -1:
            unreaped.add(value)
        conn.sendall(REAP_REPLY.pack(status, peak))
    else:
        raise EOFError(f"unexpected request {op!r}")


def _end_client(conn, children: set[int], unreaped: set[int]) -> None:
    conn.close()
    for pid in children:
        kill_group(pid)
    for pid in children:
        if not _collected(pid):
            unreaped.add(pid)


def _collected(pid: int) -> bool:
    status, _ = reap(pid, block=False)
    return status != -1 or not _exists(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


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


def preload(names, still_wanted=lambda: True) -> None:
    """Import ``names``; stop (exit) once ``still_wanted()`` says the caller is gone: a
    short run must not leave seconds of imports behind it."""
    for name in names:
        if not still_wanted():
            os._exit(0)
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional decoder must not stop the sandbox
            log.debug("swift_safe_media: preload of %s skipped: %s", name, exc)


def _fork_is_safe() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return True


def _start_sandbox(ours, prep, memory_cap_mb, policy, environment):
    caller_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if not _fork_is_safe():
        # A preloaded module started a thread: forking now could deadlock the child.
        log.warning("swift_safe_media: the zygote has threads; starting sandboxes by exec")
        pid = _exec_sandbox(sandbox_end, prep, memory_cap_mb, environment)
        sandbox_end.close()
        return pid, caller_end
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            for sock in ours:  # a sandbox must not accept, read or answer the zygote's callers
                sock.close()
            caller_end.close()
            _take_environment(environment)
            sandbox.become_sandbox(sandbox_end, memory_cap_mb, zygote, policy)
        finally:
            os._exit(70)
    sandbox_end.close()
    return pid, caller_end


def _take_environment(environment: dict) -> None:
    """The caller's environment replaces the zygote's (the caller may have changed it)."""
    if environment:
        os.environ.clear()
        os.environ.update(environment)


def _exec_sandbox(sandbox_end, prep, memory_cap_mb, environment) -> int:
    env = dict(environment or os.environ)
    env.update({name: "1" for name in config.THREAD_ENV_VARS})  # its imports, as the zygote's
    env[_PREP_ENV] = json.dumps(prep)
    os.set_inheritable(sandbox_end.fileno(), True)
    code = (f"from swift_safe_media.zygote import exec_sandbox_main; "
            f"exec_sandbox_main({sandbox_end.fileno()}, {memory_cap_mb}, {os.getpid()})")
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], env)


def exec_sandbox_main(fd: int, memory_cap_mb: int, parent: int) -> None:
    prep = json.loads(os.environ.pop(_PREP_ENV))
    _apply_preparation(prep)
    preload(prep["preload"])
    try:
        sandbox.become_sandbox(socket.socket(fileno=fd), memory_cap_mb, parent, _prepare_confinement(prep))
    finally:
        os._exit(70)


# -- both sides -----------------------------------------------------------------------
def kill_group(pid: int) -> None:
    """SIGKILL a sandbox's process group (it leads one: helpers it started go too)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)  # just forked: not yet the leader of its own group
        except (ProcessLookupError, PermissionError):
            pass
    except PermissionError:
        pass


def reap(pid: int, block: bool = True, patience: float = 2.0) -> tuple[int, int]:
    """Collect a child of this process: (wait status, peak RSS in KiB), or (-1, 0). With
    ``block=False`` it waits at most ``patience`` seconds (a shared zygote serves others)."""
    deadline = time.monotonic() + patience
    try:
        while True:
            got, status, usage = os.wait4(pid, 0 if block else os.WNOHANG)
            if got:
                return status, usage.ru_maxrss
            if time.monotonic() > deadline:
                return -1, 0
            time.sleep(0.002)
    except ChildProcessError:
        return -1, 0
