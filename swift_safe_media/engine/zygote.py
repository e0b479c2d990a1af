"""The zygote: both ends of its protocol (as CPython's ``multiprocessing/forkserver.py``).

The zygote is a fresh interpreter (never a fork of the caller, which may have threads)
that imports the decoders once and stays single-threaded, so forking a sandbox from it
is safe and takes milliseconds. Each sandbox leads its own process group, so one
SIGKILL to the group also stops helpers such as an ffmpeg child stuck on a FIFO.
Neither outlives the caller: the zygote exits on EOF of its control socket after
killing its sandboxes, and a sandbox gets SIGKILL when the zygote dies. A caller that
was killed leaves no temporary folder either: the zygote removes those it was told of.

Caller side: :class:`Zygote` starts the zygote and asks it, over the control socket,
to fork a sandbox (``SPAWN``: the reply carries the sandbox's pid and its socket) or
to reap one after the caller killed it (``REAP``: wait status and peak RSS); the owner
of the control connection also names its temporary folders (``LEFTOVERS``, no reply).
Zygote side: :func:`zygote_main`. How a zygote starts and what it takes from its caller
first is :mod:`.zygote_start`; the shared zygote's owner is :mod:`.shared_zygote`; what
runs inside a sandbox is :mod:`.sandbox`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import time

from .. import process
from . import run_folders, sandbox, transport, zygote_start

log = logging.getLogger("swift_safe_media")

# -- the wire -------------------------------------------------------------------------
SPAWN, SPAWN_UNCONFINED, SPAWN_FOR_FILES, REAP, RETIRE, LEFTOVERS = b"S", b"U", b"F", b"R", b"X", b"L"
# op, memory cap in MB (SPAWN) or pid (REAP), then that many bytes of JSON: SPAWN, the
# caller's environment, which the new sandbox takes as its own (SPAWN_UNCONFINED: a
# sandbox left unconfined, for a download, from a zygote that confines the others, so a
# rank's one zygote serves both kinds; SPAWN_FOR_FILES: a sandbox for one call of code that
# opens its files by name, confined as that call begins, with the call's own files readable
# (:func:`.sandbox.confine_then_call`); its JSON is {"environment": ..., "imports": [[module, folder or null]: modules
# the zygote imports first], "broker": null, or the caller's pid: a sandbox confined at once for many such calls, whose
# opens by name that caller answers, :mod:`..confinement.broker`}); RETIRE (no reply): kill a
# sandbox whose work is done and collect it in passing; LEFTOVERS (from the
# owner of the control connection only), its temporary folders, for the zygote to
# remove if the owner dies (the list replaces the last one; an empty one says goodbye)
CONTROL_REQUEST = struct.Struct("!cQI")
SPAWN_REPLY = struct.Struct("!q")  # pid; the sandbox's socket rides along (SCM_RIGHTS)
REAP_REPLY = struct.Struct("!qq")  # wait status, peak RSS in KiB
READY = struct.Struct("!qq")  # the zygote's pid and its parent's thread count, once it has preloaded
REQUEST_TIMEOUT_S = 5.0  # a caller sends a request whole; one that stalls mid-request is dropped


def send_control(conn: socket.socket, op: bytes, value: int, payload=None) -> None:
    """One request on a control connection (the payload as JSON)."""
    body = json.dumps(payload).encode() if payload is not None else b""
    conn.settimeout(REQUEST_TIMEOUT_S)
    conn.sendall(CONTROL_REQUEST.pack(op, value, len(body)) + body)


class SandboxHandle:
    """The caller's end of one sandbox: its pid, its socket, its lent shared blocks."""

    def __init__(self, pid: int, conn: socket.socket, memory_cap_mb: int = 0):
        self.pid, self.conn, self.memory_cap_mb = pid, conn, memory_cap_mb
        self.blocks = transport.MappedBlocks()
        self.setups_done = 0  # how many of the pool's sandbox setups have run here
        self.origin = None  # the Zygote that forked it (the only one that may reap it)
        self.grants = None  # a sandbox for one call: what it may read (engine.per_call)
        self.request = None  # the spawn request it came from: its environment and imports
        self.listener = -1  # a brokered sandbox's opens by name, answered here (confinement.broker)
        self.broker = None  # that broker during a call

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
        process.kill_group(self.pid)
        self.close()

    def close(self) -> None:
        """Close our end: an idle sandbox then exits by itself."""
        self.conn.close()
        if self.listener >= 0:
            os.close(self.listener)
            self.listener = -1


# -- caller side ----------------------------------------------------------------------
class Zygote:
    """The caller's connection to a zygote: its own (started here, ``Zygote(...)``) or
    the one its rank shares with its DataLoader workers (``Zygote.connect(address)``)."""

    def __init__(self, start_timeout: float, confined: bool = True):
        self._pending: list[SpawnAhead] = []  # spawns asked ahead, their replies not read yet
        caller_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = zygote_start.popen_zygote(zygote_end)
        zygote_end.close()
        self.control = caller_end
        deadline = time.monotonic() + start_timeout
        try:
            transport.send(self.control, transport.REQUEST, zygote_start.preparation(confined), deadline)
            self._read(READY.size, deadline)
        except BaseException as exc:
            self.close()
            # Killed (a signal: negative) or failed by itself (its imports: positive).
            exc.zygote_exit = self.process.returncode
            raise

    @classmethod
    def connect(cls, address: str) -> "Zygote":
        """A connection to a shared zygote (``OSError`` if nobody listens there any more).
        Its sandboxes die when this connection closes: with this process, say."""
        client = cls.__new__(cls)
        client.process, client._pending = None, []
        client.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.control.connect(address)
        except BaseException:
            client.control.close()
            raise
        return client

    def _read(self, size, deadline):
        return transport.receive_exactly(self.control, size, deadline)

    def spawn(self, memory_cap_mb: int, deadline: float, confined: bool = True,
              for_files: tuple[str, ...] | None = None, broker_for: int | None = None) -> SandboxHandle:
        """A new sandbox; ``for_files``: one for a call of code that opens its files by name,
        confined as that call begins, the zygote importing these modules first (``broker_for``: the wire)."""
        return self.spawn_ahead(memory_cap_mb, confined, for_files, broker_for).sandbox(deadline)

    def spawn_ahead(self, memory_cap_mb: int, confined: bool = True,
                    for_files: tuple[str, ...] | None = None, broker_for: int | None = None) -> "SpawnAhead":
        """Ask for a sandbox now and take it later (:meth:`SpawnAhead.sandbox`): the zygote
        forks it while the caller goes on (the next call's sandbox, while this call runs)."""
        body = spawn_request(for_files, broker_for)
        self._collect_replies(time.monotonic() + REQUEST_TIMEOUT_S)
        op = SPAWN_FOR_FILES if for_files is not None else SPAWN if confined else SPAWN_UNCONFINED
        self.control.settimeout(REQUEST_TIMEOUT_S)
        self.control.sendall(CONTROL_REQUEST.pack(op, memory_cap_mb, len(body)) + body)
        pending = SpawnAhead(self, memory_cap_mb, body)
        self._pending.append(pending)
        return pending

    def _collect_replies(self, deadline: float) -> None:
        """Read the replies to the spawns asked ahead, in order (the channel's next bytes)."""
        while self._pending:
            pending = self._pending[0]
            self.control.settimeout(max(deadline - time.monotonic(), 0.001))
            head, fds, _, _ = socket.recv_fds(self.control, SPAWN_REPLY.size, 1)
            if not fds:
                raise EOFError("the zygote sent no sandbox")
            head += self._read(SPAWN_REPLY.size - len(head), deadline)
            (pid,) = SPAWN_REPLY.unpack(head)
            pending.box = SandboxHandle(pid, socket.socket(fileno=fds[0]), pending.memory_cap_mb)
            pending.box.origin = self
            self._pending.pop(0)

    def retire(self, pid: int) -> None:
        """The zygote ends a sandbox whose call is done, in passing: nobody waits for it."""
        send_control(self.control, RETIRE, pid)

    def reap(self, pid: int, deadline: float) -> tuple[int, int]:
        self._collect_replies(deadline)
        self.control.settimeout(max(deadline - time.monotonic(), 0.001))
        self.control.sendall(CONTROL_REQUEST.pack(REAP, pid, 0))
        return REAP_REPLY.unpack(self._read(REAP_REPLY.size, deadline))

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        if _peer_open(self.control):  # a zygote writes only replies: between requests, EOF
            return True
        if not self._pending:
            return False
        # A reply to a spawn asked ahead is waiting: peeked at, not read (only the holder of
        # the link's lock reads the channel), and it is no end.
        try:
            return self.control.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False

    def close(self, wait: float = 2.0) -> None:
        if self.process is not None:
            try:  # a goodbye: this process lives on and removes its folders itself
                send_control(self.control, LEFTOVERS, 0, [])
            except OSError:
                pass
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


class SpawnAhead:
    """A sandbox asked of a zygote (:meth:`Zygote.spawn_ahead`), its reply maybe unread."""

    def __init__(self, zygote: Zygote, memory_cap_mb: int, request: bytes):
        self.zygote, self.memory_cap_mb, self.request = zygote, memory_cap_mb, request
        self.box: SandboxHandle | None = None

    def sandbox(self, deadline: float) -> SandboxHandle:
        """The sandbox, once the zygote has forked it (the caller holds the zygote's lock)."""
        if self.box is None:
            self.zygote._collect_replies(deadline)
        self.box.request = self.request  # what it was started with (a kept sandbox is checked against it)
        return self.box

    def matches(self, zygote: Zygote, memory_cap_mb: int, for_files, broker_for: int | None = None) -> bool:
        """Whether a call now would ask for this very sandbox (same zygote, cap, environment
        and imports): else it is ended and another one asked for."""
        return zygote is self.zygote and memory_cap_mb == self.memory_cap_mb \
            and spawn_request(for_files, broker_for) == self.request


def spawn_request(for_files, broker_for: int | None = None) -> bytes:
    """A spawn request's JSON: the caller's environment, which the sandbox takes as its own,
    and for a sandbox of code that opens its files by name the modules the zygote imports first."""
    environment = zygote_start.environment_for_sandbox()
    if for_files is not None:
        environment = {"environment": environment, "imports": list(for_files), "broker": broker_for}
    return json.dumps(environment).encode()


# -- zygote side ----------------------------------------------------------------------
def zygote_main(control_fd: int, listener_fd: int = -1) -> None:
    """Serve the caller on ``control_fd`` and, for a shared zygote, every process that
    connects to ``listener_fd``. Each connection's sandboxes die when it closes; all of
    them, and the zygote, when the control connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    process.set_name(process.ZYGOTE_NAME)
    # A host's module imported here before a fork (LLaMA-Factory's mm_plugin) must not take
    # the zygote for a new run: its start-up thread (the warm forkserver's) would leave the
    # zygote unable to fork, and every sandbox would start by exec, seconds each.
    sandbox.mark_in_sandbox()
    control = socket.socket(fileno=control_fd)
    listener = socket.socket(fileno=listener_fd) if listener_fd >= 0 else None
    # What the caller leaves behind if it dies: this socket's folder (which ends with the
    # zygote in any case) and the folders it names.
    own_folder = [os.path.dirname(listener.getsockname())] if listener is not None else []
    try:
        _, prep = transport.receive(control)
    except (EOFError, OSError):  # the caller ended before the zygote started
        run_folders.remove(own_folder)
        os._exit(0)
    leftovers = list(prep.get("leftovers") or [])

    def clean_up():
        run_folders.remove(own_folder)
        run_folders.remove_after_death(prep.get("caller", 0), leftovers)

    zygote_start.apply_preparation(prep)
    zygote_start.preload(prep["preload"], lambda: _peer_open(control), on_abandon=clean_up)
    policy = zygote_start.prepare_confinement(prep)
    gc.collect()
    gc.freeze()  # the sandboxes' collections leave the preloaded objects (and their pages) alone
    control.sendall(READY.pack(os.getpid(), int(os.environ.get(zygote_start.PARENT_THREADS_ENV, "1"))))
    clients: dict[socket.socket, set[int]] = {control: set()}  # connection -> its sandboxes
    unreaped: set[int] = set()  # killed, not yet collected (a process in D state, say)
    try:
        while True:
            waiting = [*clients, listener] if listener is not None else list(clients)
            readable, _, _ = select.select(waiting, [], [], 1.0 if unreaped else None)
            unreaped = {pid for pid in unreaped if not process.collected(pid, patience=0.0)}
            for conn in readable:
                if conn is listener:
                    _accept(listener, clients)
                    continue
                try:
                    _serve_request(conn, clients[conn], prep, policy, unreaped, waiting,
                                   leftovers if conn is control else None)
                except (EOFError, OSError):  # the caller is gone (or broke the protocol)
                    if conn is control:
                        return
                    _end_client(conn, clients.pop(conn), unreaped)
    finally:
        # The caller is gone or done: nothing of ours may outlive it.
        for children in clients.values():
            for pid in children:
                process.kill_group(pid)
        for children in clients.values():
            for pid in children:
                process.reap(pid)
        clean_up()
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


def _serve_request(conn, children: set[int], prep, policy, unreaped: set[int], ours, leftovers=None) -> None:
    """One request of one connection; ``ours``: every socket of the zygote (no sandbox keeps
    one); ``leftovers``: the owner's folders, on the control connection only."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    op, value, size = CONTROL_REQUEST.unpack(transport.receive_exactly(conn, CONTROL_REQUEST.size, deadline))
    payload = json.loads(bytes(transport.receive_exactly(conn, size, deadline))) if size else None
    conn.settimeout(REQUEST_TIMEOUT_S)
    if op in (SPAWN, SPAWN_UNCONFINED, SPAWN_FOR_FILES):
        deferred, broker_for = op == SPAWN_FOR_FILES, None
        if deferred:
            zygote_start.import_before_fork((payload or {}).get("imports") or ())
            broker_for = (payload or {}).get("broker")
            deferred, payload = broker_for is None, (payload or {}).get("environment")
        pid, caller_end = _start_sandbox(ours, prep, value, policy if op != SPAWN_UNCONFINED else None,
                                         payload or {}, deferred, broker_for)
        children.add(pid)
        try:
            socket.send_fds(conn, [SPAWN_REPLY.pack(pid)], [caller_end.fileno()])
        finally:
            caller_end.close()
    elif op == REAP and value in children:  # only a connection's own sandboxes
        children.discard(value)
        process.kill_group(value)
        status, peak = process.reap(value, block=False)
        if status == -1:
            unreaped.add(value)
        conn.sendall(REAP_REPLY.pack(status, peak))
    elif op == RETIRE and value in children:
        children.discard(value)
        process.kill_group(value)
        unreaped.add(value)  # collected as the loop goes round
    elif op == LEFTOVERS and leftovers is not None and isinstance(payload, list):
        leftovers[:] = [str(folder) for folder in payload]
    else:
        raise EOFError(f"unexpected request {op!r}")


def _end_client(conn, children: set[int], unreaped: set[int]) -> None:
    conn.close()
    for pid in children:
        process.kill_group(pid)
    for pid in children:
        if not process.collected(pid):
            unreaped.add(pid)


def _start_sandbox(ours, prep, memory_cap_mb, policy, environment, deferred=False, broker_for=None):
    caller_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if not zygote_start.fork_is_safe():
        # A preloaded module started a thread: forking now could deadlock the child.
        log.warning("swift_safe_media: the zygote has threads; starting sandboxes by exec")
        pid = zygote_start.exec_sandbox(sandbox_end, dict(prep, confine=policy is not None, deferred=deferred,
                                                          broker=broker_for), memory_cap_mb, environment)
        sandbox_end.close()
        return pid, caller_end
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            for sock in ours:  # a sandbox must not accept, read or answer the zygote's callers
                sock.close()
            caller_end.close()
            zygote_start.take_environment(environment)
            sandbox.become_sandbox(sandbox_end, memory_cap_mb, zygote, policy, deferred, broker_for)
        finally:
            os._exit(70)
    sandbox_end.close()
    return pid, caller_end
