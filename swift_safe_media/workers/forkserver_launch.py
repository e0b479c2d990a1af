"""Workers started from the forkserver without waiting for each to read its arguments.

CPython's ``popen_forkserver.Popen._launch`` writes a worker's pickled arguments (the
dataset, ``collate_fn``, ``worker_init_fn``: megabytes where they hold a tokenizer or a
processor) into a pipe and returns once the worker has read them, which is once the worker
has unpickled them, as ``pickle.load`` reads the pipe while it unpickles. A DataLoader starts
its workers one after another and sends its first indices only after the last one started,
so with fork's inherited memory gone, every worker's unpickling came before the first batch:
LLaMA-Factory's 4 MB collator took 0.2 s a worker, 0.4 s of the first batch with 2 workers.

:class:`WarmForkServerContext` is CPython's forkserver context with one change: the launch
hands the pipe to a thread that writes it, and returns as soon as the forkserver has said the
worker's pid. The workers unpickle side by side while the trainer starts the next one and
sends the indices. The preparation data the worker reads first also carries its first
sandbox's request (:mod:`.first_sandbox`). What a worker reads, and when it may begin, is
otherwise unchanged. A worker that dies
before reading all of it is what it was before to torch (a worker that exited unexpectedly);
the writer just stops.

``_launch`` repeats CPython's own but for that write: the same in 3.11 to 3.13 (run here) and
on CPython's main branch (read 2026-11-29). On a later Python, not read yet, the loader gets
CPython's own context.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import sys
import threading
from multiprocessing import context, forkserver, popen_forkserver, reduction, spawn, util

from . import first_sandbox

log = logging.getLogger("swift_safe_media")


def _write_all(fd: int, data: io.BytesIO) -> None:
    """Write the worker's arguments into its pipe, then close it (the end of the data)."""
    try:
        with open(fd, "wb", closefd=True) as pipe:
            pipe.write(data.getbuffer())
    except OSError as exc:  # the worker is gone: torch finds it dead, as it did when start() raised
        log.debug("swift_safe_media: a DataLoader worker did not read its arguments: %r", exc)


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        prep_data = spawn.get_preparation_data(process_obj._name)
        first = first_sandbox.for_launch(process_obj)
        if first is not None:  # unpickled before the arguments: the worker asks for it as it begins
            prep_data["swift_safe_media_first_sandbox"] = first
        data = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, data)
            reduction.dump(process_obj, data)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        # As CPython: a duplicate of the data pipe's write end is the child's sign that its parent lives.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        threading.Thread(target=_write_all, args=(w, data), name="swift-safe-media-worker-launch",
                         daemon=True).start()
        self.pid = forkserver.read_signed(self.sentinel)


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
