"""A DataLoader worker outlives the forkserver that started it, in its parent's eyes too.

A forkserver's processes are its children: their exit status reaches the process that
asked for them through the forkserver (``multiprocessing.popen_forkserver``). Killed
from outside, the forkserver takes that channel with it: every worker it started then
reads as exited with code 255, though it goes on working (it watches the trainer:
:mod:`.worker_watchdog`), and torch's DataLoader ended the run at its next status check
("DataLoader worker (pid(s) ...) exited unexpectedly", after a batch slower than 5 s).
Their liveness is read from a pidfd instead, which any process may hold on any other.

The pidfd reads a worker's end as it exits; its status comes a moment later, once the forkserver
has reaped it: a wait that returned at the pidfd's word alone read a worker that had exited as
still running (torch's ``join`` at an epoch's end left ``exitcode`` None, then signalled it).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import select
import signal
from multiprocessing import popen_forkserver

STATUS_PATIENCE_S = 5.0  # a worker has exited: how long its forkserver may take to say how


class OutlivesItsForkserver:
    """The ``Popen`` of a worker a forkserver started. Its exit status comes through the
    forkserver; once the forkserver is gone (its pipe at EOF, read as exit code 255) the
    worker's liveness is read from a pidfd, and its exit status is unknown."""

    def __init__(self, popen):
        self._popen = popen
        self.status_unknown = False
        self._pidfd = os.pidfd_open(popen.pid)

    def __getattr__(self, name):
        return getattr(self._popen, name)

    def poll(self, flag=os.WNOHANG):
        if self._pidfd < 0:
            return self._popen.returncode
        code = self._popen.poll(flag)
        if code == 255 and not select.select([self._pidfd], [], [], 0 if flag == os.WNOHANG else None)[0]:
            return None  # the forkserver is gone (its pipe at EOF), the worker goes on
        if code is not None:
            # Ended. Code 255 with the forkserver gone: how it ended is not known here.
            self.status_unknown = code == 255
            os.close(self._pidfd)
            self._pidfd = -1
        return code

    def wait(self, timeout=None):
        if self.poll() is None and self._pidfd >= 0 and select.select([self._pidfd], [], [], timeout)[0]:
            # It has exited: its status (or the forkserver's end, EOF) comes through the forkserver.
            multiprocessing.connection.wait([self._popen.sentinel], STATUS_PATIENCE_S)
        return self.poll()

    def terminate(self):
        self._signal(signal.SIGTERM)

    def kill(self):
        self._signal(signal.SIGKILL)

    def _signal(self, number) -> None:
        if self.poll() is None:
            try:
                if self._pidfd >= 0:  # never another process that took the pid of one reaped meanwhile
                    signal.pidfd_send_signal(self._pidfd, number)
                else:
                    os.kill(self.pid, number)
            except ProcessLookupError:
                pass


def outlives_its_forkserver(worker) -> None:
    """Give ``worker`` (a multiprocessing Process) an :class:`OutlivesItsForkserver` where a
    forkserver started it."""
    popen = getattr(worker, "_popen", None)
    # CPython's launch or ours (workers.forkserver_launch, a subclass): both read the status from the forkserver
    if isinstance(popen, popen_forkserver.Popen) and hasattr(os, "pidfd_open"):
        try:
            worker._popen = OutlivesItsForkserver(popen)
        except OSError:  # gone already: torch finds out
            pass
