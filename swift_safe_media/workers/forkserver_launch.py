"""Workers started from the forkserver without waiting for each to read its arguments.

CPython's ``popen_forkserver.Popen._launch`` writes a worker's pickled arguments (the
dataset, ``collate_fn``, ``worker_init_fn``: megabytes where they hold a tokenizer or a
processor) into a pipe and returns once the worker has read them, which is once the worker
has unpickled them, as ``pickle.load`` reads the pipe while it unpickles. A DataLoader starts
its workers one after another and sends its first indices only after the last one started,
so with fork's inherited memory gone, every worker's unpickling came before the first batch:
LLaMA-Factory's 4 MB collator took 0.2 s a worker, 0.4 s of the first batch with 2 workers.

:class:`WarmForkServerContext` is CPython's forkserver context with two changes: the launch
writes what the pipe takes at once and hands the rest to a thread that writes it, and it
returns without waiting for the forkserver to say the worker's pid (a fork of the forkserver:
15-20 ms), which is read off the worker's sentinel when first asked for. The workers are forked
and unpickle side by side while the trainer pickles the next one's arguments and sends the
indices; torch asks for every pid once all have started. The preparation data the worker reads
first also carries its first sandbox's request (:mod:`.first_sandbox`). A launch sent to a
holding server carries references to its objects without their bytes (:mod:`.held_arguments`):
a few kB the pipe takes at once. What a worker reads, and when it may begin, is otherwise
unchanged. A worker that dies before reading all of it is what it was before to torch (a worker
that exited unexpectedly); the writer just stops. A forkserver that dies before forking a
worker raises ``EOFError`` where the pid is asked for (CPython's: in ``start()``), and ``poll``
reads that worker as exited with code 255, as CPython's does.

``_launch`` repeats CPython's own but for those two changes: the same in 3.11 to 3.13 (run
here) and on CPython's main branch (read 2026-11-29), as are the ``poll`` and ``wait`` the
pid's reading wraps. On a later Python, not read yet, the loader gets CPython's own context.
"""

from __future__ import annotations

import inspect
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from multiprocessing import context, forkserver, popen_forkserver, reduction, spawn, util

from .. import config, process
from . import first_sandbox, held_arguments

log = logging.getLogger("swift_safe_media")


def _write_at_once(fd: int, data: io.BytesIO) -> int | None:
    """Write what the pipe takes now, without waiting; how much that was, or None where it was
    all of it or the worker is gone (the pipe is then closed)."""
    written = 0
    try:
        with data.getbuffer() as view:
            os.set_blocking(fd, False)
            while written < len(view):
                written += os.write(fd, view[written:])
    except BlockingIOError:  # the pipe is full: a thread writes the rest as the worker reads
        os.set_blocking(fd, True)
        return written
    except OSError as exc:  # the worker is gone: torch finds it dead, as it did when start() raised
        log.debug("swift_safe_media: a DataLoader worker did not read its arguments: %r", exc)
    os.close(fd)
    return None


def _write_all(fd: int, data: io.BytesIO, offset: int = 0) -> None:
    """Write the worker's arguments (from ``offset`` on) into its pipe, then close it (the end of the data)."""
    try:
        with open(fd, "wb", closefd=True) as pipe, data.getbuffer() as view:
            pipe.write(view[offset:])
    except OSError as exc:  # the worker is gone: torch finds it dead, as it did when start() raised
        log.debug("swift_safe_media: a DataLoader worker did not read its arguments: %r", exc)


def _worker_loop_arguments(process_obj) -> inspect.BoundArguments | None:
    """The launch's arguments bound to its target's parameters (torch's ``_worker_loop``: by
    name, whatever the torch release passes by position), or None where they do not bind."""
    try:
        return inspect.signature(process_obj._target).bind(*process_obj._args, **process_obj._kwargs)
    except (TypeError, ValueError):
        return None


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        self._what = "a holding server" if process_obj.name == held_arguments.SERVER_NAME else "a DataLoader worker"
        prep_data = spawn.get_preparation_data(process_obj._name)
        arguments = _worker_loop_arguments(process_obj)
        first = first_sandbox.for_launch(arguments)
        if first is not None:  # unpickled before the arguments: the worker asks for it as it begins
            prep_data["swift_safe_media_first_sandbox"] = first
        data = io.BytesIO()
        # A dataset and collate_fn a holding server unpickled ahead go as references to its objects.
        with held_arguments.in_place_of_held(process_obj, arguments) as (server, references):
            context.set_spawning_popen(self)
            try:
                reduction.dump(prep_data, data)
                prepared, fds = data.tell(), list(self._fds)
                reduction.dump(process_obj, data)
                to_server = self._without_bytes(process_obj, references, data, prepared, fds) if references else data
            finally:
                context.set_spawning_popen(None)
        server = server or process.current().holding_parent  # a holding server forked from another one
        self._held_by = server if server is not None and self._send(to_server, server.connect) else None
        if self._held_by is None:
            self._send(data, forkserver.connect_to_new_process)
        else:  # sent again to the warm forkserver if the server does not fork it (references carry the bytes)
            self._data = data
            # Kept for that: the caller may close its own once start() returns (a holding server's start does).
            self._fds = [os.dup(fd) for fd in self._fds]
        # The pid is read when first asked for: the forkserver forks this worker while the
        # trainer pickles the next one's arguments (torch asks for every pid once all started).

    def _without_bytes(self, process_obj, references, data: io.BytesIO, prepared: int, fds: list[int]) -> io.BytesIO:
        """The launch for the server holding the objects: ``data`` (``prepared`` bytes of
        preparation, then ``process_obj``) with references that do not carry the objects' bytes
        (megabytes the worker would read and drop). ``data`` itself where the descriptors the two
        pickles hand over differ."""
        carried, self._fds = self._fds, list(fds)
        light = io.BytesIO()
        with data.getbuffer() as view:
            light.write(view[:prepared])
        for reference in references:
            reference.carried = False
        try:
            reduction.dump(process_obj, light)
        finally:
            for reference in references:
                reference.carried = True
        if self._fds != carried:  # the same objects pickle the same descriptors: never seen
            self._fds = carried
            return data
        return light

    def _send(self, data: io.BytesIO, connect_to_new_process) -> bool:
        try:
            self.sentinel, w = connect_to_new_process(self._fds)
        except ConnectionError:  # a holding server gone: the caller asks the warm forkserver
            return False
        # As CPython: a duplicate of the data pipe's write end is the child's sign that its parent lives.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        written = _write_at_once(w, data)  # most launches from a holding server fit in the pipe
        if written is not None:
            threading.Thread(target=_write_all, args=(w, data, written), name="swift-safe-media-worker-launch",
                             daemon=True).start()
        return True

    def _pid_from_server(self) -> int:
        """The pid of a worker sent to a holding server; where the server ends without forking it
        (it could not unpickle, it was killed), or forks nothing within the start-up timeout, the
        worker is sent to the warm forkserver instead, with the same bytes."""
        server, self._held_by = self._held_by, None
        data, self._data = self._data, None
        try:
            if not multiprocessing.connection.wait([self.sentinel], config.start_timeout()):
                # It forks nothing more: the pid is there now, or never.
                server.end(f"it forked no worker within the start-up timeout ({config.start_timeout():g} s)")
            if multiprocessing.connection.wait([self.sentinel], 0):
                try:
                    return forkserver.read_signed(self.sentinel)
                except EOFError:
                    pass
            server.end(server.why_not or "it ended before it forked a worker")
            log.warning("swift_safe_media: %s's holding server did not start it (%s); the warm forkserver does",
                        self._what, server.why_not)
            self.finalizer()
            self._send(data, forkserver.connect_to_new_process)
        finally:  # the descriptors kept for a second launch: the forkserver has its own copies now
            util.close_fds(*self._fds)
            self._fds = []
        return forkserver.read_signed(self.sentinel)

    _pid = None
    _held_by = None

    @property
    def pid(self):
        if self._pid is None and self._held_by is not None:
            self._pid = self._pid_from_server()
        elif self._pid is None:  # blocks until the forkserver has forked it; EOFError if the forkserver died first
            self._pid = forkserver.read_signed(self.sentinel)
        return self._pid

    def poll(self, flag=os.WNOHANG):
        # The sentinel carries the pid, then the exit code: the pid is read off it first.
        if self.returncode is None and self._pid is None:
            if flag == os.WNOHANG and not multiprocessing.connection.wait([self.sentinel], 0):
                return None  # not even forked yet
            try:
                self.pid
            except (OSError, EOFError):  # the forkserver died before forking it, as CPython's poll reads it
                self.returncode = 255
        return super().poll(flag)

    def wait(self, timeout=None):
        if self.returncode is None and self._pid is None:
            began = time.monotonic()
            if timeout is not None and not multiprocessing.connection.wait([self.sentinel], timeout):
                return None
            self.poll()
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - began))
        return super().wait(timeout)


class _Process(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class WarmForkServerContext(context.ForkServerContext):
    """``multiprocessing.get_context("forkserver")`` but for the launch (see the module)."""

    Process = _Process


_CONTEXT = WarmForkServerContext()
LAUNCH_READ_UP_TO = (3, 15)  # the newest Python whose popen_forkserver._launch _Popen repeats


def warm_context():
    """The one context a DataLoader's workers from the warm forkserver start by."""
    if sys.version_info[:2] > LAUNCH_READ_UP_TO:
        return multiprocessing.get_context("forkserver")
    return _CONTEXT
