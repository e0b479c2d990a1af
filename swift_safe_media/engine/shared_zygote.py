"""The zygote a training process (a rank) shares with its DataLoader workers: its
owner's end (the protocol itself is :mod:`.zygote`).

One zygote per rank instead of one per worker, started early (see :mod:`..workers.forkserver`)
so its imports are done by the first batch. Callers reach it through a Unix socket in a
private folder (:mod:`.run_folders`), named in the internal setting
``SWIFT_SAFE_MEDIA_ZYGOTE`` (inherited by workers); each still gets its own sandboxes,
timeouts and errors. The listening socket exists before the zygote does, so a worker
may connect at once: its first request waits for the zygote's imports. The owner's
control connection holds the zygote's life: it ends with the owner, and then removes
the owner's temporary folders if the owner was killed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import subprocess
import threading
import time

from .. import config
from . import run_folders, transport, zygote_start
from .zygote import LEFTOVERS, READY, send_control

log = logging.getLogger("swift_safe_media")


class SharedZygote:
    """The owner's end of the rank's shared zygote."""

    def __init__(self, confined: bool):
        self.confined = confined
        self.folder = run_folders.make("zygote", for_socket=True)  # mode 0700
        self.address = os.path.join(self.folder, run_folders.SOCKET_NAME)
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
        # The control connection after READY: who may write on it, and what to send there
        # (the owner's temporary folders, changed before the zygote was ready to hear it)
        self._control_lock = threading.Lock()
        self._serving = False
        self._leftovers: list[str] | None = None
        config.put(config.ZYGOTE, self._setting())

    def _setting(self) -> str:
        return f"{'confined' if self.confined else 'unconfined'}:{self.address}"

    def start(self, start_process=None) -> None:
        """Start the zygote in the background: ``start_process(zygote_end, listener)``
        returns its process (by default, one started by exec)."""
        self.started_by = start_process or zygote_start.popen_zygote
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
            transport.send(self.control, transport.REQUEST, zygote_start.preparation(self.confined), deadline)
            self.pid, parent_threads = READY.unpack(transport.receive_exactly(self.control, READY.size, deadline))
            if parent_threads > 1:
                self.parent_problem = f"the process it was forked from has {parent_threads} threads"
                raise RuntimeError(self.parent_problem)
            with self._control_lock:
                self._serving = True
                if self._leftovers is not None:
                    send_control(self.control, LEFTOVERS, 0, self._leftovers)
        except BaseException as exc:
            self.problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if not self._closed:
                log.warning("swift_safe_media: the shared zygote could not start (%s); each process "
                            "starts its own", self.problem)
            self.close()
        finally:
            self.ready.set()

    def remove_if_caller_dies(self, folders: list[str]) -> None:
        """The owner's temporary folders, for the zygote to remove if the owner is killed."""
        with self._control_lock:
            self._leftovers = list(folders)
            if self._serving and not self._closed:
                try:
                    send_control(self.control, LEFTOVERS, 0, self._leftovers)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop the zygote and its sandboxes (callers then start zygotes of their own)."""
        if os.getpid() != self._owner:
            return
        with self._control_lock:
            if self._serving and not self._closed:
                try:  # a goodbye: the owner lives on and removes its folders itself
                    send_control(self.control, LEFTOVERS, 0, [])
                except OSError:
                    pass
            self._closed = True
        if config.get(config.ZYGOTE) == self._setting():
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
        run_folders.release(self.folder)

    def abandon(self) -> None:
        """In a forked child: the zygote is the parent's; drop our copies of its sockets."""
        for sock in (self._listener, self._zygote_end, self.control):
            sock.close()
        if isinstance(self.process, subprocess.Popen):
            self.process.returncode = 0
        elif self.process is not None:
            # multiprocessing's at-exit terminates every daemon child it lists, and a fork copies
            # the list: a child of os.fork that exits normally would send the zygote SIGTERM.
            multiprocessing.process._children.discard(self.process)


def _running(child) -> bool:
    if isinstance(child, subprocess.Popen):
        return child.poll() is None
    return child.is_alive()


def shared_address(confined: bool) -> str | None:
    """The socket of this rank's shared zygote for sandboxes of this kind, if there is one:
    a zygote that confines its sandboxes also forks unconfined ones on request (the
    confinement is applied in each sandbox, not in the zygote); one that confines none
    serves no confined sandbox."""
    value = config.get(config.ZYGOTE)
    if not value:
        return None
    kind, _, address = value.partition(":")
    return address if kind == "confined" or not confined else None
